"""Model card, offline Hub push round trip, text-generation pipeline and the local lm-evaluation-harness task."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, ModelCard, RepoUrl

import kdamoe
from kdamoe import hub, hub_card
from kdamoe.evaluate import LM_EVAL_TASK_DIR

OFFLINE_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture
def folder(model_dir, tmp_path):
    """A copy of the trained model folder (the card and push tests write into it)."""
    return shutil.copytree(model_dir, tmp_path / "model")


def _front_matter(text: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert match, "the card has no YAML front matter"
    return yaml.safe_load(match.group(1))


def test_card_yaml_holds_eval_results(folder, eval_dir, report):
    hub_card.main([str(folder), "--eval", str(eval_dir / "eval.json"), "--repo-id", "someone/kdamoe-test"])
    text = (folder / "README.md").read_text()
    meta = _front_matter(text)
    assert meta["license"] == "apache-2.0"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"custom_code", "kda", "moe"} <= set(meta["tags"])
    metrics = {m["type"]: m["value"] for r in meta["model-index"][0]["results"] for m in r["metrics"]}
    assert metrics["perplexity"] == pytest.approx(report["perplexity"]["value"], abs=1e-4)
    assert metrics["bits_per_byte"] == pytest.approx(report["bits_per_byte"]["value"], abs=1e-4)
    assert metrics["accuracy"] == pytest.approx(report["passkey"]["mean_accuracy"], abs=1e-4)
    assert meta["model-index"][0]["name"] == "kdamoe-test"
    # huggingface_hub reads its own card back, and every embedded plot was copied next to it
    card = ModelCard.load(folder / "README.md")
    assert {r.metric_type for r in card.data.eval_results} >= {"perplexity", "bits_per_byte", "accuracy"}
    plots = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(plots) == len(report["plots"]) and all((folder / p).is_file() for p in plots)
    info = json.loads((folder / "training_info.json").read_text())
    assert f"{info['tokens_trained']:,} tokens" in text


def section(card: str, title: str) -> str:
    """The text of the card's `## title` section."""
    return card.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_card_states_use_limitations_and_citations(folder):
    text = hub_card.build_card(folder, repo_id="someone/kdamoe-test").text
    assert "research model" in section(text, "Intended use") and "Python standard library" in section(text,
                                                                                                     "Intended use")
    assert "trust_remote_code" in section(text, "Limitations") and "apply_load_balancing" in section(text,
                                                                                                    "Limitations")
    citations = section(text, "Citation")
    for reference in ("arxiv.org/abs/2510.26692", "Kimi Linear", "kexue.fm/archives/11619", "Quantile Balancing",
                      "arxiv.org/abs/2603.15031", "Attention Residuals"):
        assert reference in citations
    assert "import kdamoe" not in section(text, "Usage") and "kdamoe.evaluate" not in section(text, "Usage")
    # the lm-eval task files travel with the model, unchanged
    for source in LM_EVAL_TASK_DIR.iterdir():
        if source.is_file():
            assert (folder / "lm_eval_tasks" / source.name).read_bytes() == source.read_bytes()


def test_cards_finetuning_snippets_run(folder):
    """The card's PEFT and load-balancing snippets, run as written on the trained model: LoRA on the documented
    modules, and one training step whose callback applies Quantile Balancing."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    card = hub_card.build_card(folder)
    scope = {"model": AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).train()}
    for code in re.findall(r"```python\n(.*?)```", section(card.text, "Fine-tuning"), re.S):
        exec(code, scope)
    model = scope["model"]
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.requires_grad}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "beta_proj", "gate_proj", "up_proj", "down_proj"} <= adapted
    assert any(".experts." in name for name, p in model.named_parameters() if p.requires_grad)
    assert not any("router" in name for name, p in model.named_parameters() if p.requires_grad)
    base = model.get_base_model()
    biases = [layer.ffn.router.bias.clone() for layer in base.model.layers if layer.is_moe]
    ids = torch.randint(0, base.config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    scope["LoadBalancing"]().on_step_end(None, None, None, model=model)
    after = [layer.ffn.router.bias for layer in base.model.layers if layer.is_moe]
    assert all(not torch.equal(a, b) for a, b in zip(biases, after))


def test_card_without_eval_or_config(folder, tmp_path):
    card = hub_card.build_card(folder)
    assert "model-index" not in card.data.to_dict() and "Not evaluated yet" in card.text
    with pytest.raises(ValueError, match="config.json"):
        hub_card.build_card(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        hub_card.build_card(folder, tmp_path / "missing.json")


def test_parameter_counts_match_config_formula(loaded):
    config = loaded[0].config
    counts = hub_card.parameter_counts(config)
    real = kdamoe.KDAMoEForCausalLM(config)
    d, inter, e, k = config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
    routed = config.mlp_layer_types.count("sparse") * e * 3 * d * inter  # gate, up, down per expert
    assert counts["total"] == sum(p.numel() for p in real.parameters())
    assert counts["routed_experts"] == routed
    assert counts["active_per_token"] == counts["total"] - routed + routed * k // e
    assert counts["embedding"] == config.vocab_size * d and counts["lm_head"] == 0  # tied


def test_pipeline_generates_like_the_model(model_dir, loaded):
    from transformers import pipeline

    model, tokenizer = loaded
    prompt = "def main():\n    "
    generator = pipeline("text-generation", model=str(model_dir), trust_remote_code=True)
    out = generator(prompt, max_new_tokens=8, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    ids = tokenizer(prompt, return_tensors="pt")
    expected = model.generate(**ids, max_new_tokens=8, do_sample=False)[0]
    assert list(out) == expected.tolist()
    assert len(expected) > ids["input_ids"].shape[1]


class LocalHubApi(HfApi):
    """A stand-in for the Hub that never touches the network: each commit writes its files to `root/<repo_id>/`."""

    def __init__(self, root):
        super().__init__(token=False)
        self.root = root
        self.commits = []

    def create_repo(self, repo_id, *, exist_ok=False, **kwargs):
        target = self.root / repo_id
        if target.exists() and not exist_ok:
            raise FileExistsError(repo_id)
        target.mkdir(parents=True, exist_ok=True)
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, *, commit_message, **kwargs):
        if not (self.root / repo_id).is_dir():
            raise FileNotFoundError(f"repository {repo_id} does not exist")
        paths = []
        for op in operations:
            assert isinstance(op, CommitOperationAdd)
            target = self.root / repo_id / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            with op.as_file() as f:
                target.write_bytes(f.read())
            paths.append(op.path_in_repo)
        self.commits.append({"message": commit_message, "paths": paths, **kwargs})
        oid = f"{len(self.commits):040x}"
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/{oid}", commit_message=commit_message,
                          commit_description="", oid=oid)


def test_push_round_trip_then_the_cards_snippets_generate_the_same_text(folder, tmp_path, loaded):
    (folder / "checkpoints" / "step_1").mkdir(parents=True)
    (folder / "checkpoints" / "step_1" / "optimizer.bin").write_bytes(b"x")
    (folder / ".tmp-final").mkdir()
    (folder / ".tmp-final" / "partial.bin").write_bytes(b"x")
    hub_root = tmp_path / "hub"
    pushed = hub_root / "someone" / "kdamoe-push"
    hub_card.main([str(folder), "--repo-id", str(pushed)])  # the usage snippet then loads the pushed copy
    api = LocalHubApi(hub_root)
    info = hub.push_folder(folder, "someone/kdamoe-push", api=api, commit_message="first upload")
    assert info.oid and len(api.commits) == 1 and api.commits[0]["message"] == "first upload"
    files = {p.relative_to(pushed).as_posix() for p in pushed.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "modeling_kdamoe.py", "configuration_kdamoe.py", "tokenizer.json",
            "README.md", "training_info.json"} <= files
    assert not any(f.startswith(("checkpoints/", ".tmp-")) for f in files)

    # A fresh process (no kdamoe import, offline) runs the card's usage snippets against the pushed folder: it must
    # load the pushed remote code and print what the original model generates.
    code = re.findall(r"```python\n(.*?)```", section((pushed / "README.md").read_text(), "Usage"), re.S)
    assert len(code) == 2
    script = "\n".join(code) + "\nprint(type(model).__module__)\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=OFFLINE_ENV, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model, tokenizer = loaded
    expected = []
    for prompt, new_tokens in (("def fibonacci(n):", 32), ("import os\n", 32)):
        ids = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
        expected.append(tokenizer.decode(out[0], skip_special_tokens=True))
    expected.append("transformers_modules")
    printed = result.stdout
    for text in expected:
        assert text in printed
        printed = printed[printed.index(text) + len(text):]


def test_push_rejects_a_non_model_folder(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        hub.push_folder(tmp_path, "someone/x", api=LocalHubApi(tmp_path / "hub"))


LM_EVAL_WITHOUT_KDAMOE = """
import runpy, sys
sys.modules["kdamoe"] = None  # what a Hub user has: the model repo, transformers and lm_eval, not the package
sys.argv = ["lm_eval", *sys.argv[1:]]
runpy.run_module("lm_eval", run_name="__main__")
"""


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-evaluation-harness is not installed")
def test_lm_eval_task_in_the_model_folder_runs_offline_without_the_package(folder, tmp_path):
    """The card's lm-eval command, with the repo's own copy of the task files (`lm_eval_tasks/`)."""
    hub_card.main([str(folder)])
    out = tmp_path / "lm_eval"
    cmd = [sys.executable, "-c", LM_EVAL_WITHOUT_KDAMOE, "--model", "hf", "--model_args",
           f"pretrained={folder},trust_remote_code=True", "--tasks", "kdamoe_pycloze", "--include_path",
           str(folder / "lm_eval_tasks"), "--limit", "4", "--device", "cpu", "--batch_size", "4", "--output_path",
           str(out)]
    result = subprocess.run(cmd, cwd=tmp_path, env=OFFLINE_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (results_file,) = out.rglob("results*.json")
    results = json.loads(results_file.read_text())["results"]["kdamoe_pycloze"]
    assert 0.0 <= results["acc,none"] <= 1.0 and 0.0 <= results["acc_norm,none"] <= 1.0
    assert json.loads(results_file.read_text())["n-samples"]["kdamoe_pycloze"]["effective"] == 4
