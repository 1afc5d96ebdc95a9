from xpupool.lease_manager.main import main

main()
