"""The trainer's command line: --from OUT/trainer.json, and what it refuses."""
import json
import types

from trajflow import train


def args(**kw):
    base = dict(from_file=None, brokers=None, run=None, releases=None, contract=None, init_checkpoint=None, max_updates=0)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_from_trainer_json_fills_unset_flags(tmp_path):
    info = {"brokers": ["127.0.0.1:1", "127.0.0.1:2"], "run_id": "demo", "releases": "/r", "contract": "/c.yaml",
            "init_checkpoint": "/i.ckpt", "updates": 7, "group": "demo.train"}
    f = tmp_path / "trainer.json"
    f.write_text(json.dumps(info))
    a = args(from_file=str(f), releases="/mine")  # a flag given wins
    train.apply_trainer_json(a)
    assert (a.brokers, a.run, a.releases, a.contract, a.init_checkpoint, a.max_updates) == \
        ("127.0.0.1:1,127.0.0.1:2", "demo", "/mine", "/c.yaml", "/i.ckpt", 7)


def test_from_trainer_json_of_a_language_model_run(tmp_path):
    # A language-model run has no initial checkpoint (its version 0 is the GGUF file).
    f = tmp_path / "trainer.json"
    f.write_text(json.dumps({"brokers": ["b:1"], "run_id": "r", "releases": "/r", "contract": "/c", "updates": 0}))
    a = args(from_file=str(f))
    train.apply_trainer_json(a)
    assert a.init_checkpoint is None and a.max_updates == 0


def test_refusals_exit_2(tmp_path, capsys):
    assert train.main([]) == 2
    assert "--brokers, --run, --releases, --contract required (or --from OUT/trainer.json)" in capsys.readouterr().err
    missing = tmp_path / "nope.json"
    assert train.main(["--from", str(missing)]) == 2
    assert f"--from {missing}" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run_id": "demo"}))
    assert train.main(["--from", str(bad)]) == 2
    assert "'brokers'" in capsys.readouterr().err
