from ftrun.cli.main import main

main()
