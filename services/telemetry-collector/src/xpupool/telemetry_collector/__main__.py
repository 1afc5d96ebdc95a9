from xpupool.telemetry_collector.main import main

main()
