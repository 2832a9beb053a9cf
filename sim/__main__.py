from gpuagent.sim.run import main

main()
