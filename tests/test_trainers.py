"""Fine-tuning with Hugging Face's trainers: no trainer finds an auxiliary loss on a Quantile-Balanced model (its loss
is the language-model loss), and TRL's `assistant_only_loss` trains on exactly the assistant turns."""

import json

import datasets
import pytest
import torch
import torch.nn.functional as F

import kdamoe
from conftest import tiny_config
from kdamoe.data import stdlib_dataset
from kdamoe.tokenizer import train_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "add two numbers"},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "a loop?"},
     {"role": "assistant", "content": "for i in range(3):\n    print(i)"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(stdlib_dataset("train")["text"][:20], vocab_size=320)


def make_model(tokenizer, **overrides):
    return kdamoe.KDAMoEForCausalLM(tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                eos_token_id=tokenizer.eos_token_id,
                                                bos_token_id=tokenizer.bos_token_id, **overrides))


def lm_loss(model, batch) -> torch.Tensor:
    """Reference: mean next-token cross-entropy over the labelled positions, from the model's logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=-100)


@pytest.mark.parametrize("balancing", ["quantile", "loss_free", "none", "aux_loss"])
def test_only_aux_loss_balancing_carries_an_aux_loss_coefficient(balancing):
    # transformers' MoE fields: what TRL's SFTTrainer reads to decide whether to add Mixtral's balancing loss
    default, explicit = tiny_config(router_balancing=balancing), tiny_config(router_balancing=balancing,
                                                                           router_aux_loss_coef=0.5)
    expected = (0.01, 0.5) if balancing == "aux_loss" else (0.0, 0.0)
    assert (default.router_aux_loss_coef, explicit.router_aux_loss_coef) == expected
    assert default.output_router_logits is False


def test_a_config_saved_before_the_change_reads_as_sparse_without_aux_loss(tmp_path):
    model = kdamoe.KDAMoEForCausalLM(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"] and saved["router_aux_loss_coef"] == 0
    saved.update(mlp_layer_types=["dense", "moe", "moe", "moe"], router_aux_loss_coef=0.01)  # the old spelling
    (tmp_path / "config.json").write_text(json.dumps(saved))
    old = kdamoe.KDAMoEForCausalLM.from_pretrained(tmp_path).eval()
    assert old.config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert old.config.router_aux_loss_coef == 0.0
    assert [layer.is_moe for layer in old.model.layers] == [False, True, True, True]
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(old(ids).logits, model(ids).logits, rtol=0, atol=0)


def sft_config(trl, tmp_path, **overrides):
    return trl.SFTConfig(**{**dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, max_length=64,
                                   learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                   use_cpu=True, bf16=False), **overrides})


def test_sft_trainer_loss_of_a_quantile_balanced_model_is_its_lm_loss(tokenizer, tmp_path):
    trl = pytest.importorskip("trl")
    texts = [row["text"][:400] for row in stdlib_dataset("validation").select(range(8))]
    train = datasets.Dataset.from_dict({"text": texts})
    model = make_model(tokenizer).train()
    callback = kdamoe.LoadBalancingCallback()
    trainer = trl.SFTTrainer(model=model, args=sft_config(trl, tmp_path), train_dataset=train,
                             processing_class=tokenizer, callbacks=[callback])
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert (batch["labels"] != -100).sum() > 64
    with torch.no_grad():
        torch.testing.assert_close(trainer.compute_loss(model, dict(batch)), lm_loss(model, batch),
                                   rtol=1e-5, atol=1e-5)
    trainer.train()
    assert not any("aux_loss" in entry for entry in trainer.state.log_history)
    assert callback.last_stats and any(float(layer.ffn.router.bias.abs().max()) > 0 for layer in model.model.layers
                                       if layer.is_moe)  # the callback applied Quantile Balancing
    # the check has teeth: with switch-loss balancing TRL does add its load-balancing loss
    aux = make_model(tokenizer, router_balancing="aux_loss").train()
    aux_trainer = trl.SFTTrainer(model=aux, args=sft_config(trl, tmp_path), train_dataset=train,
                                 processing_class=tokenizer)
    with torch.no_grad():
        assert aux_trainer.compute_loss(aux, dict(batch)) > lm_loss(aux, batch) + 1e-4


def test_assistant_only_loss_trains_on_the_assistant_turns(tokenizer, tmp_path):
    trl = pytest.importorskip("trl")
    train = datasets.Dataset.from_dict({"messages": CONVERSATIONS})
    args = sft_config(trl, tmp_path, assistant_only_loss=True, max_length=None)
    trainer = trl.SFTTrainer(model=make_model(tokenizer), args=args, train_dataset=train, processing_class=tokenizer)
    for i, messages in enumerate(CONVERSATIONS):
        # reference: the tokens whose characters lie in an assistant turn's content and its closing <|im_end|>
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        spans, at = [], 0
        for message in messages:
            piece = message["content"] + "<|im_end|>"
            start = text.index(piece, at)
            at = start + len(piece)
            if message["role"] == "assistant":
                spans.append((start, at))
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(s <= a and b <= e for s, e in spans) for a, b in encoded["offset_mapping"]]
        batch = trainer.data_collator([trainer.train_dataset[i]])
        assert batch["input_ids"][0].tolist() == encoded["input_ids"]
        expected = [t if m else -100 for t, m in zip(encoded["input_ids"], mask)]
        assert batch["labels"][0].tolist() == expected and sum(mask) > 0


def test_lora_on_all_linear_adapts_every_projection():
    """PEFT LoRA with `target_modules="all-linear"`: every adapter takes part in the forward (its input gradient is
    non-zero once lora_B is), the dense MLP's and the shared experts' included, whose plain projections otherwise run
    as one fused GEMM on their weights."""
    peft = pytest.importorskip("peft")
    from conftest import tiny_model

    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(3, model.config.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    adapters = {name.split(".lora_A")[0]: p.grad for name, p in model.named_parameters() if "lora_A" in name}
    assert any(".ffn.gate_proj" in name for name in adapters) and any(".shared_experts.down_proj" in name
                                                                       for name in adapters)
    idle = [name for name, grad in adapters.items() if grad is None or not grad.any()]
    assert not idle, idle
