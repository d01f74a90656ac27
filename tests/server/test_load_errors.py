"""`rackserve serve` on a broken checkpoint: one line naming the fix, exit code 2, no
traceback, and no process started (the checks read only headers and config files)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rackserve.cli import main


def truncate_weights(d: Path) -> None:
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def drop_tensor(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, d / "model.safetensors")


def reshape_tensor(d: Path) -> None:
    tensors = load_file(d / "model.safetensors")
    name = next(k for k in sorted(tensors) if tensors[k].dim() == 2)
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, d / "model.safetensors")


def config_list(d: Path) -> None:
    (d / "config.json").write_text("[1, 2]")


def config_without(key: str) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        config.pop(key)
        (d / "config.json").write_text(json.dumps(config))

    return edit


def remove_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()
    (d / "tokenizer_config.json").unlink()


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (truncate_weights, "cannot read"),
        (drop_tensor, "missing tensors"),
        (reshape_tensor, "shape mismatches"),
        (config_list, "must hold a JSON object"),
        (config_without("hidden_size"), "config.json lacks hidden_size"),
        (config_without("vocab_size"), "config.json lacks vocab_size"),
        (remove_tokenizer, "--tokenizer"),
    ],
)
def test_broken_checkpoint_fails_in_one_line(
    tiny_model: Path, tmp_path: Path, capsys, breakage, expected: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    breakage(model)
    assert main(["serve", str(model), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_tokenizer_flag_points_elsewhere(tiny_model: Path, tmp_path: Path, capsys) -> None:
    argv = ["serve", str(tiny_model), "--port", "0", "--tokenizer", str(tmp_path / "nowhere")]
    assert main(argv) == 2
    assert "pass --tokenizer DIR" in capsys.readouterr().err
