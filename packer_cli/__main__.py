"""``python -m packer_cli``: the ``packer`` command, for an environment whose scripts directory
is not on ``PATH``."""
from packer_cli._entry import main

if __name__ == "__main__":
    main()
