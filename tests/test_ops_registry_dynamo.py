"""The op registry's eager calls do not import torch._dynamo; once it is imported, calls go through torch's wrapper.

``torch.library.custom_op`` wraps every kernel in ``torch._disable_dynamo``,
whose first call imports torch._dynamo (2-3 s). Every spawned gloo rank paid
that on its first cpattn op although it never compiles. The registry now calls
the plain kernel until torch._dynamo is imported (nothing can set dynamo's
frame callback before), and torch's wrapper from then on.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter (importing torch) per test

CALL = "o, l = registry.call('merge_attn_states', torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1))\n"


def _run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_eager_op_calls_do_not_import_dynamo():
    out = _run("import sys, torch\nfrom cpattn.ops import registry\n" + CALL +
               "print(round(l.item(), 4), 'torch._dynamo' in sys.modules)\n")
    assert out == ["0.6931", "False"]


def test_after_dynamo_is_imported_calls_go_through_torchs_disable_wrapper():
    # the first call after the import goes through torch's wrapper, which then makes torch._dynamo.disable(kernel)
    out = _run("import sys, torch\nfrom cpattn.ops import registry\n" + CALL +
               "import torch._dynamo\n"
               "made = []\n"
               "real = torch._dynamo.disable\n"
               "torch._dynamo.disable = lambda fn, *a, **k: made.append(fn) or real(fn, *a, **k)\n" + CALL +
               "print(len(made), round(l.item(), 4))\n")
    assert out == ["1", "0.6931"]
