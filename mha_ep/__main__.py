from mha_ep.cli import main
import sys

sys.exit(main())
