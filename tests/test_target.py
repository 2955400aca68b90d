import torch

from draftflow.config import TinyTargetConfig
from draftflow.target import build_tiny_target, load_target


def test_tiny_target_is_deterministic_and_an_ordinary_hf_folder(tmp_path, tiny_target):
    again = build_tiny_target(TinyTargetConfig(), tmp_path)
    assert again.fingerprint == tiny_target.fingerprint  # same bytes on a fresh build
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(again.path)
    tok = AutoTokenizer.from_pretrained(again.path)
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 8
    assert model.config.vocab_size > len(tok)  # room for the DFlash mask token id len(tokenizer)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_padding_rows_never_win_greedy(tiny_target):
    model, tok = load_target(tiny_target.path)
    ids = torch.tensor([tok.encode("What is the capital of France?")])
    logits = model(ids).logits[0]
    assert int(logits.argmax(-1).max()) < len(tok)


def test_release_targets_forgets_the_cached_model(tiny_target):
    """Before torchrun ranks take the GPUs, the flow process drops the targets it cached."""
    from draftflow.target import release_targets

    first, _ = load_target(tiny_target.path)
    assert load_target(tiny_target.path)[0] is first  # cached per process
    release_targets()
    again, _ = load_target(tiny_target.path)
    assert again is not first
    assert all(not p.is_meta for p in again.parameters())


def test_a_model_folder_is_hashed_once_per_version_of_its_files(tmp_path, monkeypatch):
    """`draftflow run` and `status` fingerprint the target each time: a 16 GB folder must not be
    re-read while its files keep their sizes and mtimes."""
    import os

    from draftflow import target as target_mod

    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    first = target_mod.folder_fingerprint(model)
    assert list((tmp_path / "cache" / "fingerprints").iterdir())  # kept for the next process
    target_mod._content_hash.cache_clear()  # as in a new process
    st = weights.stat()
    weights.write_bytes(b"b" * 64)  # same size; mtime put back: only a content read could tell
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert target_mod.folder_fingerprint(model) == first  # answered from the cache, not re-read
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version of the file
    assert target_mod.folder_fingerprint(model) != first


def _copy_target(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_config_with_more_layers_than_the_weights_is_one_line(tmp_path, tiny_target):
    """transformers would initialise layer 8 at random and go on; draftflow names the missing tensors."""
    import json

    import pytest

    from draftflow.errors import ConfigError

    folder = _copy_target(tiny_target.path, tmp_path / "t")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"] + cfg["layer_types"][-1:]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_target(str(folder), "float32", "cpu")
    msg = str(err.value)
    assert "\n" not in msg and "missing (model.layers.8." in msg and "and " in msg and "more" in msg


def test_weights_the_config_does_not_name_are_one_line(tmp_path, tiny_target):
    import pytest
    from safetensors.torch import load_file, save_file

    from draftflow.errors import ConfigError

    folder = _copy_target(tiny_target.path, tmp_path / "t")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.99.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"1 unexpected \(model\.layers\.99\.mlp\.up_proj\.weight\)"):
        load_target(str(folder), "float32", "cpu")


def test_a_tensor_of_another_shape_is_one_line(tmp_path, tiny_target):
    import pytest
    from safetensors.torch import load_file, save_file

    from draftflow.errors import ConfigError

    folder = _copy_target(tiny_target.path, tmp_path / "t")
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        load_target(str(folder), "float32", "cpu")
    assert "\n" not in str(err.value) and "up_proj" in str(err.value)
