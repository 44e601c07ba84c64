"""``fcprag run``: the host script runs with transformers' and peft's FutureWarnings ignored, and nothing else."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Warnings attributed to a module are what `warnings` filters by: code run with that module's __name__ raises them
# exactly as transformers' and peft's own code does.
HOST = '''
import warnings

def warn_from(module, category, text):
    exec("import warnings\\nwarnings.warn(TEXT, CATEGORY)", {"__name__": module, "TEXT": text, "CATEGORY": category})

warn_from("transformers.modeling_utils", FutureWarning, "hidden-transformers-future")
warn_from("peft.tuners.tuners_utils", FutureWarning, "hidden-peft-future")
warn_from("peft.tuners.tuners_utils", UserWarning, "shown-peft-user")
warn_from("transformers_extra", FutureWarning, "shown-other-package-future")
warn_from("torch.nn.modules", FutureWarning, "shown-torch-future")
warnings.warn("shown-script-future", FutureWarning)
warnings.warn("shown-script-deprecation", DeprecationWarning)  # __main__'s own: shown by default
print("host ran")
'''


@pytest.mark.slow
def test_only_transformers_and_peft_future_warnings_are_quiet(tmp_path):
    script = tmp_path / "host.py"
    script.write_text(HOST, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-m", "fcprag_tools.cli", "run", "prag", "--", str(script)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "host ran" in proc.stdout
    assert "hidden-" not in proc.stderr, proc.stderr
    for shown in ("shown-peft-user", "shown-other-package-future", "shown-torch-future", "shown-script-future",
                  "shown-script-deprecation"):
        assert shown in proc.stderr, (shown, proc.stderr)
    # outside the host script the filters are gone: the same process's later warnings are shown
    proc = subprocess.run([sys.executable, "-c", (
        "import warnings, sys\n"
        "from fcprag_tools.cli import main\n"
        f"main(['run', 'prag', '--', {str(script)!r}])\n"
        "exec('import warnings\\nwarnings.warn(\"after-run\", FutureWarning)', {'__name__': 'peft.x'})\n")],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and "after-run" in proc.stderr, proc.stderr[-2000:]
