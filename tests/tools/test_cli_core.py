"""`fcprag fuse` and `fcprag inspect`."""

import json
import subprocess
import sys

import torch

from fcprag_plugin import FusionController, LoraAdapter
from fcprag_tools.cli import main
from helpers import dense_reference, make_adapter_dir, tiny_model

GATE = "model.layers.0.mlp.gate_proj"


def test_fuse_writes_peft_dir_and_fusion_json(adapter_dirs, tmp_path, capsys):
    ctrl = FusionController.fixed(g=0.8, tau=0.1, embed_dim=384).save_pretrained(tmp_path / "ctrl")
    pfile = tmp_path / "p2.txt"
    pfile.write_text("the eiffel tower is in paris")
    args = ["fuse", "--query", "capital of france", "--controller", str(ctrl), "--out", str(tmp_path / "out")]
    for d, p in zip(adapter_dirs, ["paris is the capital of france", "bananas are yellow", f"@{pfile}"]):
        args += ["--adapter", str(d), "--passage", p]
    assert main(args) == 0
    info = json.loads((tmp_path / "out" / "fusion.json").read_text())
    assert len(info["merge_weights"]) == 3 and abs(sum(info["merge_weights"]) - 3) < 1e-4
    assert abs(info["g"] - 0.8) < 1e-6 and info["controller_mode"] == "fixed"
    from peft import PeftModel

    pm = PeftModel.from_pretrained(tiny_model(), str(tmp_path / "out"), adapter_name="f")
    live = LoraAdapter.from_peft_model(pm, "f")
    ads = [LoraAdapter.from_pretrained(d) for d in adapter_dirs]
    torch.testing.assert_close(live[GATE].delta(torch.float64), dense_reference(ads, info["merge_weights"], GATE),
                               rtol=1e-5, atol=1e-6)
    assert "w~=" in capsys.readouterr().out


def test_fuse_mismatched_counts_is_an_error(adapter_dirs, tmp_path, capsys):
    rc = main(["fuse", "--query", "q", "--adapter", str(adapter_dirs[0]), "--out", str(tmp_path / "o"),
               "--adapter", str(adapter_dirs[1]), "--passage", "only one"])
    assert rc == 2
    assert "2 --adapter but 1 --passage" in capsys.readouterr().err


def test_inspect_prints_and_warns(tmp_path, capsys):
    good = make_adapter_dir(tmp_path / "good", r=2, alpha=32)
    zero = make_adapter_dir(tmp_path / "zero", zero_b=True)
    assert main(["inspect", str(good), str(zero), "--per-module"]) == 0
    out = capsys.readouterr().out
    assert "rank: [2]" in out and "scaling: [16.0]" in out and "'down_proj', 'gate_proj', 'up_proj'" in out
    assert out.count("every lora_B is zero") == 1 and GATE in out


def test_inspect_bad_dir_names_it(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "missing: adapter directory not found" in capsys.readouterr().err


def test_console_script_entry_point(tmp_path):
    exe = [sys.executable, "-m", "fcprag_tools.cli", "--help"]
    out = subprocess.run(exe, capture_output=True, text=True, check=True).stdout
    assert "fuse" in out and "inspect" in out
