import sys

from cpattn.cli import main

sys.exit(main())
