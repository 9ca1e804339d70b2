from dtrun.launcher.entry import main

main()
