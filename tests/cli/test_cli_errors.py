"""The CLI's bad arguments: each is one line naming what is wrong, with exit code 2, never a traceback."""

from __future__ import annotations

import onnx

from small_models import one_mha, run_cli


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_dim_without_value_is_a_one_line_error(tmp_path):
    """cli._dims raises argparse.ArgumentTypeError from inside cmd_compare (not from an argparse `type=`), and
    main() catches only FileNotFoundError/ValueError/MhaEpError: `--dim batch` prints a traceback and exits 1,
    which the CLI documents as "outputs outside tolerance". Expected: one-line error, exit 2."""
    source = tmp_path / "m.onnx"
    onnx.save(one_mha(), source)
    done = run_cli("compare", str(source), "--backend", "reference", "--dim", "batch")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "--dim expects NAME=VALUE" in done.stderr


def test_cli_partition_output_to_a_directory_is_a_one_line_error(tmp_path):
    """`mha-ep partition IN -o DIR`: save_model's os.replace raises IsADirectoryError (NotADirectoryError for
    "DIR/"), an OSError that main() does not catch: a traceback instead of the one-line error the CLI gives for
    other bad paths. Expected: exit 2, one line naming the path."""
    source = tmp_path / "m.onnx"
    onnx.save(one_mha(), source)
    (tmp_path / "out").mkdir()
    done = run_cli("partition", str(source), "-o", str(tmp_path / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
