from xpupool.autoscaler.main import main

main()
