"""HostOffload: saved activations in host memory give the gradients of plain autograd; a tensor saved twice is
copied once. On CPU the hooks take CPU tensors as the device's (`device_types=("cpu",)`), so every save is copied."""

import torch

import kdamoe
from conftest import tiny_config
from kdamoe.offload import HostOffload


def test_offloaded_saves_give_autograd_gradients_and_copy_a_shared_tensor_once():
    x = torch.randn(64, 32, requires_grad=True)
    with HostOffload(min_bytes=0, device_types=("cpu",)) as hooks:
        y = (x.sin() * x.cos()).sum()  # sin and cos both save x; mul saves sin(x) and cos(x)
    y.backward()
    nbytes = x.numel() * x.element_size()
    assert hooks.saved_bytes == 4 * nbytes and hooks.offloaded_bytes == 3 * nbytes
    torch.testing.assert_close(x.grad, torch.cos(2 * x.detach()), rtol=1e-6, atol=1e-6)  # d/dx sin(x)cos(x)


def test_a_tensor_changed_in_place_is_copied_again():
    """Each save keeps the value it saw: sin saves z, then z doubles in place and cos saves it again."""
    x = torch.randn(16, requires_grad=True)
    with HostOffload(min_bytes=0, device_types=("cpu",)) as hooks:
        z = x * 1.0
        a = z.sin()
        z.mul_(2.0)
        y = (a + z.cos()).sum()
    y.backward()
    assert hooks.offloaded_bytes == 2 * x.numel() * x.element_size()  # z before and after the doubling
    expected = x.detach().cos() - 2.0 * (2.0 * x.detach()).sin()
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-6)


def test_checkpointed_model_with_offload_gives_the_same_gradients():
    """Activation checkpointing and Block AttnRes: the layers' inputs (the completed blocks are every later layer's
    input) move to host memory, each once, and the gradients are those of checkpointing alone."""
    model = kdamoe.KDAMoEForCausalLM(tiny_config(router_balancing="none", attnres_block_layers=1)).train()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids = torch.randint(3, 97, (2, 24))

    def grads(hooks):
        model.zero_grad()
        with hooks:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    hooks = HostOffload(min_bytes=0, device_types=("cpu",))
    offloaded = grads(hooks)
    assert 0 < hooks.offloaded_bytes < hooks.saved_bytes
    assert plain.keys() == offloaded.keys()
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
