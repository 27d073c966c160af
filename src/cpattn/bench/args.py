"""Old path of :mod:`cpattn.config.cli_args` (the command line's shared vocabulary),
re-exported: import it from there.

(No DeprecationWarning yet: tests still import this path.)
"""

from cpattn.config.cli_args import (  # noqa: F401
    input_dir, input_file, json_output, output_dir, output_file, output_file_made, TIMEOUT_S,
    DTYPE_ALIASES, PARALLEL, GRAPH_BACKENDS, MODEL_TYPES, FLAG_OF_FIELD, HelpFormatter, Parser,
    parser, usage_error, bad_value, _int, positive_int, nonnegative_int, positive_float, int_list,
    dtype_name, backend_unavailable, _torch_build, check_backend, add_parallel, add_dtype, add_json,
    add_quick, add_timeout, add_progress, check_engine, speak_problems, report_stream, report_to,
)

__all__ = ["input_dir", "input_file", "json_output", "output_dir", "output_file", "output_file_made",
           "TIMEOUT_S", "DTYPE_ALIASES", "PARALLEL", "GRAPH_BACKENDS", "MODEL_TYPES", "FLAG_OF_FIELD",
           "HelpFormatter", "Parser", "parser", "usage_error", "bad_value", "positive_int",
           "nonnegative_int", "positive_float", "int_list", "dtype_name", "backend_unavailable",
           "check_backend", "add_parallel", "add_dtype", "add_json", "add_quick", "add_timeout",
           "add_progress", "check_engine", "speak_problems", "report_stream", "report_to"]
