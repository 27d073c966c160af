"""Old path of :mod:`cpattn.config.cli_paths` (argparse types for paths), re-exported: import it from there.

(No DeprecationWarning yet: tests still import this path.)
"""

from cpattn.config.cli_paths import (  # noqa: F401
    _shown, output_file, output_file_made, output_dir, input_file, input_dir, json_output,
)

__all__ = ["output_file", "output_file_made", "output_dir", "input_file", "input_dir", "json_output"]
