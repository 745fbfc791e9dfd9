"""What a run sees, for tests/test_warm_cli.py: ``python -m tests.warm_cli_probe ARGS`` prints its module name and
spec, ``LANTERN_PROBE``, whether it leads its session, its arguments, working directory and parent as JSON; with
``sleep`` as its first argument it starts a child and both sleep a minute instead."""

import json
import os
import subprocess
import sys
import time

if sys.argv[1:2] == ["sleep"]:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(60)
print(
    json.dumps(
        {
            "main": [__name__, __spec__.name],
            "variable": os.environ.get("LANTERN_PROBE"),
            "leads_session": os.getsid(0) == os.getpid(),
            "args": sys.argv[1:],
            "cwd": os.getcwd(),
            "parent": os.getppid(),
        }
    )
)
