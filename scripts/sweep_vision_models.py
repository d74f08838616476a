"""Image models as timm and torchvision define them, with random weights at small image sizes,
through tilefuse on this machine's default target: inference outputs and a training step's
gradients (dropout and drop-path off, batch norms on batch statistics) against the same model
in fp64, each beside eager fp32's own error. Needs `timm` and/or `torchvision` (a library
missing is reported, not fatal).

    PYTHONPATH=src:scripts python scripts/sweep_vision_models.py [all|name,name,...] [infer,train]

Names are `timm:<model>` or `tv:<model>`; `all` is the list below. A training step that misses
on the first input is tried on three more draws and passes only where it passes them all and
eager itself misses the bound on one of them (see `run`).

Found on 2026-12-06: a ResMLP training step compiled for minutes (the recompute pass walked a
residual chain's gradient as a tree; fixed); verify mode named a batch norm's counter as the
first diverging kernel (fixed); every model matched eager.
"""
import sys
import warnings

import torch

import tilefuse
from model_check import compare, sweep

#: (name, image size): small variants of each family, at the smallest size each accepts
TIMM = [
    ("resnet18", 64), ("resnet50d", 64), ("resnext26ts", 64), ("seresnext26d_32x4d", 64),
    ("efficientnet_b0", 64), ("mobilenetv3_small_100", 64), ("mobilenetv4_conv_small", 64),
    ("ghostnet_100", 64), ("rexnet_100", 64), ("regnetx_002", 64), ("regnety_002", 64),
    ("densenet121", 64), ("dla34", 64), ("cspresnet50", 64), ("dpn48b", 64), ("res2net50_14w_8s", 64),
    ("resnest14d", 64), ("skresnet18", 64), ("ese_vovnet19b_dw", 64), ("repvgg_a0", 64),
    ("hrnet_w18_small", 64), ("inception_v3", 96), ("nf_resnet26", 64), ("tinynet_e", 64),
    ("lcnet_050", 64), ("convnext_atto", 64), ("convnextv2_atto", 64), ("edgenext_xx_small", 64),
    ("fastvit_t8", 64), ("poolformer_s12", 64), ("efficientformer_l1", 224), ("mobilevitv2_050", 64),
    ("vit_tiny_patch16_224", 32), ("deit_tiny_distilled_patch16_224", 32), ("deit3_small_patch16_224", 32),
    ("cait_xxs24_224", 32), ("xcit_nano_12_p16_224", 32), ("beit_base_patch16_224", 32),
    ("swin_tiny_patch4_window7_224", 56), ("swinv2_cr_tiny_ns_224", 112), ("maxvit_nano_rw_256", 64),
    ("coatnet_nano_rw_224", 64), ("levit_128s", 64), ("pvt_v2_b0", 64), ("twins_svt_small", 64),
    ("mixer_s16_224", 32), ("resmlp_12_224", 32), ("gcvit_xxtiny", 64), ("davit_tiny", 64),
    ("focalnet_tiny_srf", 64), ("efficientvit_b0", 64), ("botnet26t_256", 64), ("halonet26t", 256),
    ("lambda_resnet26t", 64), ("visformer_tiny", 64), ("crossvit_tiny_240", 240), ("tnt_s_patch16_224", 32),
    ("sequencer2d_s", 64), ("eva02_tiny_patch14_224", 28), ("hiera_tiny_224", 64), ("vitamin_small_224", 64),
]
TORCHVISION = [
    ("resnet50", 64), ("mobilenet_v2", 64), ("mobilenet_v3_large", 64), ("efficientnet_b0", 64),
    ("efficientnet_v2_s", 64), ("convnext_tiny", 64), ("densenet121", 64), ("shufflenet_v2_x1_0", 64),
    ("squeezenet1_1", 64), ("mnasnet0_5", 64), ("regnet_y_400mf", 64), ("googlenet", 64),
    ("vgg11_bn", 64), ("alexnet", 64), ("vit_b_16", 32), ("swin_t", 64), ("swin_v2_t", 64),
    ("maxvit_t", 224),
]
SIZES = {f"timm:{n}": s for n, s in TIMM} | {f"tv:{n}": s for n, s in TORCHVISION}


def _create(name, size):
    library, model_name = name.split(":")
    if library == "timm":
        import timm
        kwargs = {"num_classes": 5, "drop_rate": 0.0, "drop_path_rate": 0.0}
        if any(k in model_name for k in ("vit", "deit", "cait", "xcit", "beit", "swin", "mixer", "resmlp",
                                          "tnt", "eva", "crossvit", "levit", "hiera", "maxvit", "coatnet",
                                          "twins", "pvt", "sequencer", "davit", "gcvit", "focalnet", "visformer",
                                          "botnet", "halonet")):
            kwargs["img_size"] = size
        if any(k in model_name for k in ("vit_tiny_patch16", "deit", "cait", "beit", "mixer", "resmlp", "tnt")):
            kwargs["patch_size"] = 8 if "tnt" in model_name else 4
        attempts = ((), ("patch_size",), ("img_size", "patch_size"), ("img_size", "patch_size", "drop_path_rate"))
        for k, dropped in enumerate(attempts):  # some families take no img_size, patch_size or drop_path_rate
            try:
                return timm.create_model(model_name, **{a: v for a, v in kwargs.items() if a not in dropped})
            except TypeError:
                if k == len(attempts) - 1:
                    raise
    import torchvision
    kwargs = {"num_classes": 5}
    if model_name == "vit_b_16":  # its builder fixes the patch size: the class, at a small width
        return torchvision.models.VisionTransformer(image_size=size, patch_size=4, num_layers=2, num_heads=4,
                                                    hidden_dim=64, mlp_dim=128, **kwargs)
    if model_name == "googlenet":
        kwargs |= {"aux_logits": False, "init_weights": False}
    return getattr(torchvision.models, model_name)(**kwargs)


def _prepared(model):
    """The model with dropout off and every all-zero parameter (zero-initialised heads, last
    norms of residual branches) drawn small and random: a zero output or branch checks nothing."""
    for module in model.modules():  # nn.Dropout, torchvision's StochasticDepth, timm's DropPath
        if "Drop" in type(module).__name__ or "Stochastic" in type(module).__name__:
            for attribute in ("p", "drop_prob"):
                if isinstance(getattr(module, attribute, None), float):
                    setattr(module, attribute, 0.0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return model


def run(name, train):
    size = SIZES.get(name, 64)
    torch.manual_seed(0)
    model = _prepared(_create(name, size))
    ref = _prepared(_create(name, size))
    ref.load_state_dict(model.state_dict())
    ref.double()
    model.train(train)
    ref.train(train)
    torch._dynamo.reset()
    compiled = tilefuse.compile(model, fallback="error")
    first = (lambda out: out[0] if isinstance(out, (tuple, list)) else out)

    def check(seed, stats=None):
        x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(seed))
        return compare(model, ref, torch.float64, compiled, train, {"x": x}, first, stats)

    first_stats: dict = {}
    ok, msg = check(1, first_stats)
    if ok or not train or "worst" not in first_stats:
        return ok, msg
    # A training step of ReLU-family activations after batch norms is ill-conditioned: a value
    # within rounding of the kink takes the other branch in one of the runs (fp32 or fp64),
    # and the gradient behind it moves by a large step. Such a miss is judged on three more
    # draws: it is a boundary, not a bug, where tilefuse passes all of them and eager itself
    # misses the oracle's bound (1e-4 of the largest gradient) on one of them.
    stats = [{} for _ in range(3)]
    again = [check(seed, st) for seed, st in zip((2, 3, 4), stats)]
    eager_misses = max(st.get("eager_worst", 0.0) for st in stats)
    detail = " | ".join(m.split("; ", 1)[1] for _, m in again)
    if all(good for good, _ in again) and eager_misses >= 1e-4:
        return True, msg + "; a boundary: OK on 3 more draws, where eager misses the bound: " + detail
    return False, msg + "; on 3 more draws: " + detail


def main():
    args = sys.argv[1:]
    names = args[0].split(",") if args and args[0] != "all" else list(SIZES)
    modes = args[1].split(",") if len(args) > 1 else ["infer", "train"]
    warnings.simplefilter("ignore")
    sweep(names, modes, run)


if __name__ == "__main__":
    main()
