from barrelctl.app import main

main()
