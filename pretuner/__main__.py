from pretuner.cli import main

main()
