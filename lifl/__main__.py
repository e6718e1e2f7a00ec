from lifl.cli import main

main()
