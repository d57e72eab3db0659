"""bitsparse_core.torch.convert: state_dict unchanged, training bit-identical, report."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from bitsparse_core.torch import convert  # noqa: E402
from bitsparse_core.torch.convert import (PackedBlock, Skip, packed_modules,  # noqa: E402
                                          register_rule, unregister_rule)


def _same_state(a: nn.Module, b: nn.Module, shared: bool):
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert list(sa) == list(sb)
    for k in sa:
        if shared:
            assert sa[k] is sb[k], k
        else:
            assert torch.equal(sa[k], sb[k]), k


def _train_same(ref, conv, loss_fn, steps=2):
    """Forward outputs, gradients and parameters equal bit for bit over a few SGD steps."""
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(conv.parameters(), lr=0.1)
    for step in range(steps):
        lr_, lc = loss_fn(ref, step), loss_fn(conv, step)
        assert torch.equal(lr_, lc), step
        opt_r.zero_grad()
        opt_c.zero_grad()
        lr_.backward()
        lc.backward()
        for (n, p), (_, q) in zip(ref.named_parameters(), conv.named_parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), (step, n)
        opt_r.step()
        opt_c.step()
    _same_state(ref, conv, shared=False)


def _convert_checked(model, **kw):
    before = model.state_dict(keep_vars=True)
    report = convert(model, **kw)
    after = model.state_dict(keep_vars=True)
    assert list(before) == list(after)
    assert all(before[k] is after[k] for k in before)
    again = convert(model, **kw)
    assert again.replaced == [] and sorted(again.already) == sorted(p for p, *_ in report.replaced)
    assert list(model.state_dict()) == list(before)
    return report


# ---------------------------------------------------------------- nn.Sequential rule

def _relu2():
    return pytest.importorskip("transformers.activations").ReLUSquaredActivation()


@pytest.mark.parametrize("act,kind", [(nn.ReLU, "PackedReLUFFN"), (_relu2, "PackedReLU2FFN")])
def test_sequential_rule(act, kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 32), act(), nn.Linear(32, 16)),
                          nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
                          nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    report = _convert_checked(model, encoding="raw")
    assert report.replaced == [("1", "sequential", kind)]
    assert report.skipped == [("2", "sequential", "activation is GELU, not ReLU / ReLU²")]
    assert isinstance(model[1], PackedBlock) and model[1].packed.encoding == "raw"
    x = torch.randn(2, 5, 8)
    _train_same(ref, model, lambda m, s: m(x + s).square().mean())


def test_root_block_is_reported_not_replaced():
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    report = convert(m)
    assert report.replaced == [] and report.skipped[0][0] == ""


def test_user_rule_and_unrecognised():
    class MyFFN(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.act, self.down = nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 8)

        def forward(self, x):
            return self.down(self.act(self.up(x)))

    class Other(MyFFN):
        pass

    model = nn.ModuleDict({"a": MyFFN(), "b": Other()})
    ref = copy.deepcopy(model)
    rule = register_rule("myffn", lambda m: type(m) is MyFFN,
                         lambda m, **kw: PackedBlock(m, "up", "down", "relu", **kw))
    try:
        report = _convert_checked(model, density=1.0)
    finally:
        unregister_rule(rule)
    assert report.replaced == [("a", "myffn", "PackedReLUFFN")]
    assert report.unrecognised == [("b", "Other")]
    x = torch.randn(6, 8)
    _train_same(ref, model, lambda m, s: (m["a"](x) * (s + 1)).sum())


def test_skip_from_user_rule_is_reported():
    def builder(m, **kw):
        raise Skip("not today")
    rule = register_rule("never", lambda m: isinstance(m, nn.Sequential), builder)
    try:
        report = convert(nn.ModuleList([nn.Sequential(nn.Linear(2, 2))]))
    finally:
        unregister_rule(rule)
    assert report.skipped == [("0", "never", "not today")]


# ---------------------------------------------------------------- transformers

def _opt(act="relu", **kw):
    tf = pytest.importorskip("transformers")
    cfg = tf.OPTConfig(hidden_size=16, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                       vocab_size=50, max_position_embeddings=32, word_embed_proj_dim=16,
                       activation_function=act, dropout=0.0, attention_dropout=0.0, **kw)
    torch.manual_seed(0)
    return tf.OPTForCausalLM(cfg).float()


def _lm_loss(ids):
    def loss(m, step):
        return m(input_ids=ids, labels=ids).loss * (1 + step)
    return loss


@pytest.mark.parametrize("act,kind", [("relu", "PackedReLUFFN"), ("relu2", "PackedReLU2FFN")])
def test_opt(act, kind):
    model = _opt(act)
    model.train()
    ref = copy.deepcopy(model)
    report = _convert_checked(model)
    assert report.replaced == [(f"model.decoder.layers.{i}", "opt", kind) for i in range(2)]
    assert list(packed_modules(model)) == [p for p, *_ in report.replaced]
    layer = model.model.decoder.layers[0]
    assert isinstance(layer, type(ref.model.decoder.layers[0]))   # same object, a subclass
    assert isinstance(layer.fc1, nn.Linear)          # outside forward: the original modules
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    _train_same(ref, model, _lm_loss(ids))
    stats = layer.__dict__["_bitsparse_packed"].stats()
    assert stats["packs"] >= 2


def test_opt_offloaded():
    """convert(offload=...): every converted layer shares the one Offloader, and training
    stays bit-identical with the packed blocks moved to its pool."""
    from bitsparse_core.torch import Offloader
    model = _opt("relu")
    model.train()
    ref = copy.deepcopy(model)
    off = Offloader(ahead=1)
    report = _convert_checked(model, offload=off)
    assert len(report.replaced) == 2
    assert all(m.offload is off for m in packed_modules(model).values())
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    _train_same(ref, model, _lm_loss(ids))
    assert off.stats()["offloaded"] == 4 and off.stats()["kept_on_device"] == 0


@pytest.mark.filterwarnings("ignore::FutureWarning")   # gradient_checkpointing_enable
def test_opt_gradient_checkpointing_and_hidden_states():
    model = _opt()
    ref = copy.deepcopy(model)
    convert(model)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    _train_same(ref, model, _lm_loss(ids))
    a, b = (m(input_ids=ids, output_hidden_states=True).hidden_states for m in (model, ref))
    assert len(a) == len(b) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert model.model.decoder.layers[0].__dict__["_bitsparse_packed"].stats()["packs"] >= 2


def test_opt_gelu_is_skipped_with_reason():
    model = _opt("gelu")
    report = convert(model)
    assert report.replaced == []
    assert [(p, r) for p, r, _ in report.skipped] == [(f"model.decoder.layers.{i}", "opt")
                                                     for i in range(2)]
    assert "GELUActivation" in report.skipped[0][2]


def _t5(proj="relu", dropout=0.0):
    tf = pytest.importorskip("transformers")
    cfg = tf.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=64, num_layers=2, num_heads=2,
                      feed_forward_proj=proj, dropout_rate=dropout, decoder_start_token_id=0)
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(cfg).float()


def test_t5():
    model = _t5()
    model.train()
    ref = copy.deepcopy(model)
    report = _convert_checked(model)
    paths = [p for p, _, _ in report.replaced]
    assert len(paths) == 4 and all(p.endswith("layer.1.DenseReluDense")
                                   or p.endswith("layer.2.DenseReluDense") for p in paths)
    assert {r for _, r, _ in report.replaced} == {"t5"}
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    _train_same(ref, model, lambda m, s: m(input_ids=ids, labels=ids).loss * (1 + s))


def test_t5_dropout_and_gated_are_skipped():
    report = convert(_t5(dropout=0.1))
    assert report.replaced == [] and len(report.skipped) == 4
    assert "dropout p=0.1" in report.skipped[0][2]
    report = convert(_t5(proj="gated-gelu"))
    assert report.replaced == [] and "not ReLU" in report.skipped[0][2]


def test_t5_gated_relu_is_reglu():
    model = _t5(proj="gated-relu")
    model.train()
    ref = copy.deepcopy(model)
    report = _convert_checked(model, encoding="nosign")
    assert len(report.replaced) == 4 and {k for *_, k in report.replaced} == {"PackedReGLUFFN"}
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(6))
    _train_same(ref, model, lambda m, s: m(input_ids=ids, labels=ids).loss * (1 + s))


def test_unknown_kwarg_raises():
    with pytest.raises(TypeError, match="encodng"):
        convert(nn.Linear(2, 2), encodng="raw")


def test_t5_dropout_switched_on_later_falls_back_to_dense():
    model = _t5()
    ref = copy.deepcopy(model)
    convert(model)
    for m in (model, ref):
        for mod in m.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.2
    model.train()
    ref.train()
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(5)
    a = model(input_ids=ids, labels=ids).loss
    torch.manual_seed(5)
    b = ref(input_ids=ids, labels=ids).loss
    assert torch.equal(a, b)


def test_report_str():
    report = convert(_opt("gelu"))
    assert "skipped" in str(report) and "GELUActivation" in str(report)


# ---------------------------------------------------------------- copies, module API, compile

def _packed_of(model):
    return list(packed_modules(model).values())


def _saved_and_loaded(model, tmp_path, monkeypatch):
    """torch.save + torch.load as in a fresh process: the runtime subclasses are made again."""
    import importlib
    convert_module = importlib.import_module("bitsparse_core.torch.convert")  # not the function
    path = tmp_path / "model.pt"
    torch.save(model, path)
    monkeypatch.setattr(convert_module, "_SUBCLASSES", {})
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("make", ["opt", "sequential"])
def test_freeze_capacity_finds_the_converted_ffns(make):
    """A converted model's packed FFNs are not registered submodules (a converted OPT
    layer's, a PackedBlock's): ``capacity_policies`` lists each one's policy once, and
    ``freeze_capacity`` finds them all the same."""
    from bitsparse_core.torch import capacity_policies, freeze_capacity, thaw_capacity
    if make == "opt":
        model = _opt()
    else:
        model = nn.Sequential(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)),
                              nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)))
    convert(model)
    packed = _packed_of(model)
    assert len(packed) == 2
    pols = capacity_policies(model)
    assert len(pols) == 2 and {id(p) for p in pols} == {id(p.capacity_policy) for p in packed}
    assert freeze_capacity(model) == 2
    assert all(p.capacity_policy.frozen for p in packed)
    assert thaw_capacity(model) == 2 and not any(p.capacity_policy.frozen for p in packed)


@pytest.mark.parametrize("make", ["opt", "t5", "sequential"])
def test_converted_model_copies(make, tmp_path, monkeypatch):
    """deepcopy and torch.save/torch.load of a converted model: same state_dict, still
    converted, trains bit-identically to the unconverted model, and each copy counts its
    own packs (the policies are found by id: a copy must not share the original's)."""
    from bitsparse_core.torch import capacity
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(8))
    if make == "opt":
        model, loss = _opt(), _lm_loss(ids)
    elif make == "t5":
        model, loss = _t5(), _lm_loss(ids[:, :6].contiguous())
    else:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                              nn.Linear(32, 16)))
        x = torch.randn(3, 8)
        loss = lambda m, s: m(x + s).square().mean()  # noqa: E731
    model.train()
    ref = copy.deepcopy(model)
    assert convert(model).replaced
    copies = [copy.deepcopy(model), _saved_and_loaded(model, tmp_path, monkeypatch)]
    for c in copies:
        _same_state(model, c, shared=False)
        assert type(c) is type(model) or make == "opt"
        assert [type(p) for p in _packed_of(c)] == [type(p) for p in _packed_of(model)]
        assert convert(c).replaced == []            # already converted
        for p, q in zip(_packed_of(c), _packed_of(model)):
            assert p.capacity_policy.id != q.capacity_policy.id
            assert capacity.POLICIES[p.capacity_policy.id] is p.capacity_policy
            # the copy's packed FFN computes with the copy's own linears
            assert all(a is not b for a, b in zip(p.parameters(), q.parameters()))
        before = [p.stats()["packs"] for p in _packed_of(model)]
        _train_same(copy.deepcopy(ref), c, loss)
        assert all(p.stats()["packs"] > 0 for p in _packed_of(c))
        assert [p.stats()["packs"] for p in _packed_of(model)] == before


def test_opt_layer_class_pickles_by_the_original_class():
    import pickle
    model = _opt()
    convert(model)
    layer = model.model.decoder.layers[0]
    blob = pickle.dumps(layer)
    assert b"PackedOPTDecoderLayer" not in blob       # named through the original class
    again = pickle.loads(blob)
    assert type(again) is type(layer) and "_bitsparse_packed" in again.__dict__


@pytest.mark.filterwarnings("ignore::FutureWarning")   # gradient_checkpointing_enable
def test_opt_module_api_after_convert():
    """The converted OPT layer's instance dict shadows fc1 / activation_fn / fc2 only
    during its forward; train/eval, state_dict / load_state_dict, to(dtype) and gradient
    checkpointing on and off behave as on the unconverted model."""
    model, ids = _opt(), torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(9))
    ref = copy.deepcopy(model)
    convert(model)
    layer = model.model.decoder.layers[0]
    plain_keys = set(ref.model.decoder.layers[0].__dict__) | {"_bitsparse_packed"}
    packs = lambda: _packed_of(model)[0].stats()["packs"]  # noqa: E731

    for mode in ("eval", "train"):
        getattr(model, mode)()
        getattr(ref, mode)()
        assert all(m.training == (mode == "train") for m in model.modules())
        a, b = (m(input_ids=ids, labels=ids).loss for m in (model, ref))
        assert torch.equal(a, b)
        assert set(layer.__dict__) == plain_keys      # no shadow left behind
    def fail(*_):
        raise KeyError("midway")
    hook = layer.self_attn.register_forward_hook(fail)   # fails inside the shadowed forward
    with pytest.raises(KeyError, match="midway"):
        model(input_ids=ids)
    hook.remove()
    assert set(layer.__dict__) == plain_keys

    # load_state_dict into the converted model: the packed path uses the new values
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.load_state_dict(ref.state_dict())
    n = packs()
    assert torch.equal(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)
    assert packs() == n + 1

    # to(dtype): packed in bf16; float64 (not packed) runs the original forward; back again
    for dtype, packed in ((torch.bfloat16, True), (torch.float64, False), (torch.float32, True)):
        model.to(dtype)
        ref.to(dtype)
        n = packs()
        _train_same(ref, model, _lm_loss(ids), steps=1)
        assert (packs() > n) == packed, dtype

    # gradient checkpointing on, then off again
    for on in (True, False):
        for m in (model, ref):
            if on:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                m.gradient_checkpointing_disable()
        assert layer.gradient_checkpointing == on
        n = packs()
        _train_same(ref, model, _lm_loss(ids), steps=1)
        assert packs() == n + (2 if on else 1)        # checkpointing: forward + recompute


def test_float64_is_skipped_with_reason():
    report = convert(_opt().double())
    assert report.replaced == [] and "torch.float64" in report.skipped[0][2]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_opt_compiled_matches_compiled_unconverted():
    """torch.compile(backend="aot_eager") of a converted OPT: one graph, no break, the
    packed custom ops inside it, losses and gradients bit-identical to the same model
    compiled unconverted."""
    import torch._dynamo as dynamo
    model, ids = _opt(), torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(10))
    model.train()
    ref = copy.deepcopy(model)
    convert(model)
    for m, ops in ((ref, 0), (model, 2)):
        dynamo.reset()
        explain = dynamo.explain(m)(input_ids=ids, labels=ids)
        assert (explain.graph_count, explain.graph_break_count) == (1, 0), explain.break_reasons
        # the packed FFN's autograd.Function (its body calls bitsparse::relu_linear), per layer
        targets = [str(n.target) for g in explain.graphs for n in g.graph.nodes]
        assert targets.count("autograd_function_apply") == ops
    dynamo.reset()
    compiled = [torch.compile(m, backend="aot_eager") for m in (ref, model)]
    n = _packed_of(model)[0].stats()["packs"]
    _train_same(*compiled, _lm_loss(ids), steps=2)
    assert _packed_of(model)[0].stats()["packs"] == n + 2
    dynamo.reset()


@pytest.mark.parametrize("order, error", [
    (("fc1", "activation_fn", "fc2"), None),
    (("fc1", "fc2"), "fc2 called outside"),
    (("activation_fn",), "activation_fn called outside"),
    (("fc1", "activation_fn"), "fc1 ran without fc2"),
], ids=["in-order", "no-activation", "activation-alone", "no-fc2"])
def test_inline_stand_ins_hold_the_forward_to_fc1_act_fc2(order, error):
    """A converted layer's forward sees fc1 / activation_fn / fc2 stand-ins: back to back
    they run the packed FFN; any other use raises, and the layer's own attributes are
    back after the call either way."""
    import importlib
    cv = importlib.import_module("bitsparse_core.torch.convert")

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.activation_fn = nn.Linear(4, 8), nn.Linear(8, 4), nn.ReLU()

        def forward(self, x):
            for name in order:
                x = getattr(self, name)(x)
            return x
    layer = Layer()
    linears = (layer.fc1, layer.fc2, layer.activation_fn)
    layer.__dict__["_bitsparse_packed"] = lambda x: ("packed", x)
    layer.__class__ = cv._inline_class(Layer)
    x = torch.randn(2, 4)
    if error is None:
        out = layer(x)
        assert out[0] == "packed" and out[1] is x
    else:
        with pytest.raises(RuntimeError, match=error):
            layer(x)
    assert (layer.fc1, layer.fc2, layer.activation_fn) == linears
    assert not {"fc1", "fc2", "activation_fn"} & layer.__dict__.keys()
