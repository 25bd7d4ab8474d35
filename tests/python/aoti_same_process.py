"""Reproducer for issue 3, item 5: compile an AOTInductor package, then load it with
torch._inductor.aoti_load_package and run it, all in one Python process.

On torch 2.11 a CUDA package of customops ops made and loaded this way segfaulted, while
customops-run (C++) ran the same package. test_aoti.py runs this script in a subprocess, so a crash
is reported as a test failure instead of killing pytest. Each stage prints a line once it is done
(stdout is flushed), so the last "stage:" line says where a crash happened; faulthandler prints the
Python stack of a fatal signal on stderr.

    python tests/python/aoti_same_process.py --device cuda OUT_DIR              # compile, load, run
    python tests/python/aoti_same_process.py --device cuda --model aten_only OUT_DIR
    python tests/python/aoti_same_process.py --device cuda --load-only OUT_DIR  # a fresh process
    python tests/python/aoti_same_process.py --device cuda --release OUT_DIR    # free before exit

--model aten_only packages the same kind of work in ATen ops only: if that crashes too, customops
is not the cause. The package is OUT_DIR/<model>-<device>.pt2.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import time

faulthandler.enable()


def stage(msg: str) -> None:
    print(f"stage: {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=["every_op", "aten_only"], default="every_op")
    p.add_argument("--load-only", action="store_true", help="load OUT_DIR's package made by an earlier run")
    p.add_argument("--release", action="store_true", help="delete the loaded model before exiting")
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    import aoti_models
    import customops

    stage(f"imported torch {torch.__version__}, customops {customops.__version__}")
    torch.manual_seed(0)
    case = getattr(aoti_models, args.model)(args.device)
    path = os.path.join(args.out_dir, f"{args.model}-{args.device}.pt2")
    if not args.load_only:
        start = time.perf_counter()
        customops.export.package(case.module, case.inputs(3), path, dynamic_shapes=case.dynamic_shapes)
        stage(f"compiled {path} in {time.perf_counter() - start:.1f} s")

    model = torch._inductor.aoti_load_package(path)
    stage("loaded")
    for n in aoti_models.BATCH_SIZES:
        inputs = case.inputs(n)
        got = model(*inputs)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        want = aoti_models.eager(case, inputs)
        assert len(got) == len(want), f"{len(got)} outputs, eager has {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, msg=lambda m: f"batch {n}, output {i}: {m}")
        stage(f"ran batch {n}: {len(got)} outputs equal eager")

    if args.release:
        del model
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        stage("released the model")
    stage("exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
