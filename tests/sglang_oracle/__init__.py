"""SGLang's own code as the test oracle (the conformance tier, ``tests/test_sglang_*.py``).

SGLang's server cannot run on the CPU machine (no CPU kernels), but its wheel (installed with
``--no-deps`` by ``scripts/setup_env.sh``) imports there: its HTTP app, request structs, sampling
parameter checks, server-argument parser and weight-update code are the real thing.
``import_sglang()`` imports them. The one thing missing is torchvision (no build matches the CPU
torch): SGLang's multimodal modules import it at load time and the code under test never calls
it, so a placeholder stands in for it, whose every function raises if called. transformers is
imported first, so that it records torchvision as absent (it would otherwise try to use it).

``oracle_engine.py`` is an SGLang server for tests built from those parts.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

SGLANG_VERSION = "0.5.23"


class _Absent:
    """A torchvision attribute: any call raises (the code under test must never reach one)."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is absent in SGLang's conformance tier")

    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return _Absent(f"{self._name}.{key}")

    def __mro_entries__(self, bases):  # a class deriving from a torchvision class still defines
        return (object,)


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def attr(key: str, _name=spec.name):
            if key.startswith("__"):
                raise AttributeError(key)
            return _Absent(f"{_name}.{key}")
        mod.__getattr__ = attr
        return mod

    def exec_module(self, module) -> None:
        pass


def import_sglang() -> types.SimpleNamespace:
    """SGLang's modules used as the oracle; raises ImportError if SGLang is not installed."""
    import transformers  # noqa: F401  (first: it must see torchvision as absent)

    try:
        import torchvision  # noqa: F401
    except ImportError:
        if not any(isinstance(f, _TorchvisionPlaceholder) for f in sys.meta_path):
            sys.meta_path.insert(0, _TorchvisionPlaceholder())
    except Exception:  # a torchvision that does not match this torch ("operator ... does not exist")
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        sys.meta_path.insert(0, _TorchvisionPlaceholder())
    import sglang
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt import server_args
    from sglang.srt.utils import common
    from sglang.srt.weight_sync import tensor_bucket

    return types.SimpleNamespace(version=sglang.__version__, io_struct=io_struct, SamplingParams=SamplingParams,
                                 server_args=server_args, common=common, tensor_bucket=tensor_bucket)


ORACLE_ENGINE = Path(__file__).resolve().parent / "oracle_engine.py"


@contextlib.contextmanager
def running_oracles(model, log_dir, specs: dict[str, tuple[int, tuple[str, ...]]]):
    """Start oracle engines in parallel, ``{name: (tp_size, extra flags)}``; yield ``{name: url}``
    once each answers ``/health``; stop them all afterwards. A missing SGLang is an error, never a
    skip (the conformance tier must run)."""
    import asyncio
    import concurrent.futures as cf
    import socket
    import subprocess
    import time

    import_sglang()
    from sglang_protocol.client import EngineClient

    def start(name: str, tp: int, extra: tuple[str, ...]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = Path(log_dir) / f"oracle_{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, str(ORACLE_ENGINE), "--model-path", str(model), "--port",
                                     str(port), "--tp-size", str(tp), *extra], stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"

        async def up() -> bool:
            async with EngineClient(url, timeout=2) as c:
                return await c.health(timeout=2)  # SGLang lets /health through without a key
        deadline = time.monotonic() + 240
        while not asyncio.run(up()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"oracle engine {name} did not start: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        return proc, url

    procs = {}
    try:
        with cf.ThreadPoolExecutor(len(specs)) as ex:
            futs = {k: ex.submit(start, k, tp, tuple(extra)) for k, (tp, extra) in specs.items()}
            for k, f in futs.items():
                procs[k] = f.result()
        yield {k: url for k, (_, url) in procs.items()}
    finally:
        for p, _ in procs.values():
            p.terminate()
        for p, _ in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
