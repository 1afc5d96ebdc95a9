from xpupool.scheduler.main import main

main()
