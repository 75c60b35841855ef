"""rocAL itself, as rocal_loader.py calls it; nothing here knows a plan or a loader. ``import_rocal``,
``rocal_version``, ``rocal_pipeline`` and ``release_pipelines``; an output checked, then copied by ``copy_output`` (CPU
backend) or ``device_images`` (GPU backend, through DLPack). What is known of rocAL's C++ comes from its source:
docs/vendors.md names the files and functions.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import io
import os
import sys
import tempfile
import threading
import warnings

import numpy as np
import jax
import jax.numpy as jnp

from arithmetic import Normalize
from cifar_mnist import IMAGE_SHAPE, TRAIN_PREFIX

INSTALL_HINT = ("the rocAL backend needs AMD rocAL's Python package amd.rocal, which is not on PyPI: on a ROCm host "
                "install the OS packages 'rocal' and 'rocal-dev' (e.g. `apt install rocal rocal-dev`) and run with "
                "PYTHONPATH=/opt/rocm/lib, where they put amd.rocal; or build rocAL for its CPU backend and put its "
                "lib folder on PYTHONPATH and LD_LIBRARY_PATH")
BUILD_ATTEMPTS = 3
# What rocAL prints on every pipeline it builds; kept off stdout (anything else is passed on).
ROCAL_CHATTER = ("Pipeline has been created succesfully", "OK: loaded ")


def import_rocal():
    """``(Pipeline, fn, types)`` from amd.rocal; ImportError saying how to install it."""
    try:
        from amd.rocal.pipeline import Pipeline
        import amd.rocal.fn as fn
        import amd.rocal.types as types
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} (import failed: {error})") from error
    return Pipeline, fn, types


def rocal_version() -> str:
    """rocAL's version from its library's file name (rocAL has no version call): "X.Y.Z", "?" when its library's name
    holds none, "not installed" when rocAL does not import."""
    try:
        import rocal_pybind
    except ImportError:
        return "not installed"
    names = glob.glob(os.path.join(os.path.dirname(rocal_pybind.__file__), "librocal.so.*.*.*"))
    return names[0].rsplit(".so.", 1)[1] if names else "?"


# rocAL 2.3.0's rocal_release() can block for ever, holding the GIL (docs/vendors.md). The bound is
# far above a release that returns: its longest wait is a 0.1 s sleep (MasterGraph::output_routine).
RELEASE_TIMEOUT_S = 2.0
_UNRELEASED: list = []  # (where, thread) of every release that did not return within its bound


class RocalReleaseWarning(RuntimeWarning):
    """A pipeline whose ``rocal_release()`` did not return within ``RELEASE_TIMEOUT_S``, left unreleased."""


def unreleased() -> list[str]:
    """The pipelines of this process whose release is still blocked, by where they were read."""
    return [where for where, thread in _UNRELEASED if thread.is_alive()]


def release_pipelines(pipelines, where: str = "rocAL") -> None:
    """Releases each of ``pipelines`` ({shard k: pipeline} or a sequence) on a daemon thread, waiting at most
    ``RELEASE_TIMEOUT_S`` for each; one still running then is listed by ``unreleased()`` and named in a
    ``RocalReleaseWarning`` ("<where>, shard k"). Once all are released, RuntimeError names each release that raised."""
    named = pipelines.items() if isinstance(pipelines, dict) else enumerate(pipelines)
    errors = []
    for k, pipe in list(named):
        label = f"{where}, shard {k}"
        release, outcome = _release_call(pipe), []

        def run(release=release, outcome=outcome):
            try:
                outcome.append(release())
            except BaseException as error:  # handed to the caller
                outcome.append(error)

        thread = threading.Thread(target=run, name=f"rocal_release ({label})", daemon=True)
        thread.start()
        thread.join(RELEASE_TIMEOUT_S)
        if thread.is_alive():
            _UNRELEASED.append((label, thread))
            warnings.warn(RocalReleaseWarning(
                f"{label}: rocal_release() did not return within {RELEASE_TIMEOUT_S} s (rocAL 2.3.0's "
                f"lost wake-up: a worker thread missed the notify that stops it); the pipeline is left "
                f"unreleased, its threads and buffers stay until the process exits"), stacklevel=2)
        elif isinstance(outcome[0], BaseException):
            errors.append(f"{label}: rocal_release() raised {type(outcome[0]).__name__}: {outcome[0]}")
    if errors:
        raise RuntimeError("; ".join(errors))


def _release_call(pipe):
    """A function that releases ``pipe``: rocAL's C ``rocalRelease`` on its ``_handle`` capsule (ctypes drops the GIL,
    so the bound holds), or the ``rocal_release`` of an object without one."""
    handle = getattr(pipe, "_handle", None)
    if type(handle).__name__ != "PyCapsule":
        return pipe.rocal_release
    capsule_name, capsule_pointer, c_release = _rocal_c_api()
    context = capsule_pointer(handle, capsule_name(handle))
    pipe._handle = None  # a later call on it fails in Python, never on a freed context
    return lambda: c_release(context)


@functools.lru_cache(maxsize=1)
def _rocal_c_api():
    """(PyCapsule_GetName, PyCapsule_GetPointer, rocalRelease) as ctypes functions; rocalRelease is looked up through
    the pybind module, so it is the librocal the binding calls."""
    import rocal_pybind
    api = ctypes.PyDLL(None)  # Python's C API: called with the GIL held
    name, pointer = api.PyCapsule_GetName, api.PyCapsule_GetPointer
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    release = ctypes.CDLL(rocal_pybind.__file__).rocalRelease
    release.restype, release.argtypes = ctypes.c_int, [ctypes.c_void_p]
    return name, pointer, release


def _check_remaining(pipe, where: str, want: int, what: str) -> None:
    remaining = _call(f"{where}, after build()", "get_remaining_images()", pipe.get_remaining_images)
    if remaining != want:
        raise RuntimeError(f"{where}: get_remaining_images() = {remaining} for {what}; expected {want}")


def _hardware_id(device: jax.Device) -> int:
    return device.local_hardware_id if device.local_hardware_id is not None else device.id


def check_dlpack() -> None:
    """RuntimeError (``DLPACK_MISSING``) unless rocAL's tensor type has ``dlpack_device``: rocAL defines it only when
    built with DLPack (rocAL_pybind/rocal_pybind.cpp)."""
    import rocal_pybind
    tensor_type = getattr(rocal_pybind, "rocalTensor", None)
    if tensor_type is None or not hasattr(tensor_type, "dlpack_device"):
        raise RuntimeError(DLPACK_MISSING)


DLPACK_MISSING = ("this rocAL was built without DLPack (ENABLE_DLPACK off: CMake did not find dlpack's header), so its "
                  "GPU outputs (rocalTensor) have no dlpack_device() and their __dlpack__ raises 'Dlpack not "
                  "installed'; the GPU backend needs DLPack to hand its outputs to JAX. Rebuild rocAL with dlpack "
                  "installed (e.g. Debian's libdlpack-dev, or the dlpack headers from github.com/dmlc/dlpack), or use "
                  "CPU devices")


def rocal_pipeline(file_root: str, *, batch_size: int, normalize: Normalize, on_gpu: bool, device_id: int = 0,
                   shard_id: int = 0, num_shards: int = 1, filename_prefix: str = TRAIN_PREFIX, shuffle: bool = False,
                   seed: int = 0, num_threads: int = 1, last_batch_policy: str = "FILL", pad_last_batch: bool = True):
    """A built Pipeline: ``fn.readers.cifar10``, then ``fn.crop_mirror_normalize`` to float32 NCHW; rocAL's CPU backend
    or, ``on_gpu``, its GPU backend on GPU ``device_id``. The loader reads with FILL + pad_last_batch; the other
    policies show what rocAL does. Raises RuntimeError when the graph does not verify (rocAL's build() calls exit), or
    the build raised RuntimeError ``BUILD_ATTEMPTS`` times, or anything else once; a failed pipeline is released."""
    Pipeline, fn, types = import_rocal()
    crop = normalize.crop or IMAGE_SHAPE[1:]
    failures = []
    for _ in range(BUILD_ATTEMPTS):
        said: list[str] = []
        pipe = None
        try:
            with _rocal_chatter_hidden(said):
                pipe = Pipeline(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed,
                                rocal_cpu=not on_gpu, tensor_layout=types.NCHW, tensor_dtype=types.FLOAT,
                                output_memory_type=types.DEVICE_MEMORY if on_gpu else types.HOST_MEMORY)
                with pipe:
                    raw = fn.readers.cifar10(
                        file_root=file_root, shard_id=shard_id, num_shards=num_shards, filename_prefix=filename_prefix,
                        random_shuffle=shuffle, last_batch_policy=getattr(types, f"LAST_BATCH_{last_batch_policy}"),
                        pad_last_batch=pad_last_batch)
                    out = fn.crop_mirror_normalize(
                        raw, output_layout=types.NCHW, output_dtype=types.FLOAT, crop=tuple(crop),
                        crop_pos_x=normalize.crop_pos[1], crop_pos_y=normalize.crop_pos[0],
                        mirror=int(normalize.mirror),  # explicit: rocAL's default 1 flips every image
                        mean=list(normalize.mean), std=list(normalize.std))
                    pipe.set_outputs(out)
                pipe.build()
            return pipe
        except (SystemExit, Exception) as error:
            if pipe is not None:  # a half-built pipeline's threads and buffers would stay
                release_pipelines({shard_id: pipe}, f"rocAL, a failed build ({file_root})")
            if isinstance(error, SystemExit):  # rocAL's build() exits when its graph does not verify
                raise RuntimeError(f"rocAL pipeline of shard {shard_id} ({file_root}): the graph did not "
                                   f"verify, and rocAL called exit({error.code}); it printed: "
                                   f"{' | '.join(said).strip()!r}") from None
            if not isinstance(error, RuntimeError):  # anything else would fail again
                raise RuntimeError(f"rocAL pipeline of shard {shard_id} ({file_root}): building raised "
                                   f"{type(error).__name__}: {error}") from error
            failures.append(str(error).strip())  # rocAL's build fails now and then: retried
    raise RuntimeError(f"rocAL pipeline of shard {shard_id} ({file_root}): building failed "
                       f"{BUILD_ATTEMPTS} times; rocAL said: {failures}")


def copy_output(tensor, out: np.ndarray, where: str = "rocAL") -> None:
    """``tensor.copy_data(out)`` (a raw memcpy), after checking what rocAL does not. Raises RuntimeError, naming
    ``where`` and writing nothing, when the tensor is not NCHW, or ``out`` is not a C-contiguous, writeable array of
    its dtype and dimensions."""
    dims, dtype = tuple(int(d) for d in tensor.dimensions()), np.dtype(tensor.dtype())
    problems = [text for bad, text in [
        (tensor.layout() != "NCHW", f"NCHW, rocAL's output is {tensor.layout()}"),
        (out.shape != dims, f"shape {out.shape}, rocAL's output is {dims}"),
        (out.dtype != dtype, f"dtype {out.dtype}, rocAL's output is {dtype}"),
        (not out.flags.c_contiguous, "not C-contiguous"),
        (not out.flags.writeable, "read-only")] if bad]
    if problems:
        raise RuntimeError(f"{where}: will not copy rocAL's output into a buffer that is "
                           f"{'; '.join(problems)} (its copy_data would write the raw bytes anyway)")
    tensor.copy_data(out)


class RocalDLPack:
    """A rocAL output as ``jax.dlpack.from_dlpack`` wants it: rocAL's ``dlpack_device`` and ``__dlpack__``
    take the GPU id (a legacy "dltensor" capsule); JAX calls ``__dlpack_device__()``, ``__dlpack__(stream=...)``."""

    def __init__(self, tensor, device_id: int):
        self.tensor, self.device_id = tensor, device_id

    def __dlpack__(self, stream=None, **_):  # rocAL ignores streams
        return self.tensor.__dlpack__(self.device_id)

    def __dlpack_device__(self) -> tuple[int, int]:
        kind, index = self.tensor.dlpack_device(self.device_id)
        return int(kind), int(index)


def device_images(tensor, device: jax.Device, image_shape: tuple, batch_size: int, where: str = "rocAL") -> jax.Array:
    """A rocAL output as a jax.Array on ``device``, copied through DLPack. The copy is only enqueued: the caller waits
    for it before rocAL writes the buffer again (``rocal_loader._Transfers``). Raises RuntimeError, naming ``where``,
    for an output that is not float32 (batch_size, *image_shape) NCHW, or a rocAL built without DLPack
    (``DLPACK_MISSING``)."""
    dims, want = tuple(int(d) for d in tensor.dimensions()), (batch_size,) + tuple(image_shape)
    if dims != want or np.dtype(tensor.dtype()) != np.float32 or tensor.layout() != "NCHW":
        raise RuntimeError(f"{where}: rocAL's output is {tensor.dtype()} {dims} {tensor.layout()}, "
                           f"expected float32 {want} NCHW")
    try:
        alias = jax.dlpack.from_dlpack(RocalDLPack(tensor, _hardware_id(device)), device=device)
    except AttributeError as error:  # no dlpack_device: rocAL built without DLPack
        raise RuntimeError(f"{where}: {DLPACK_MISSING} ({error})") from error
    except RuntimeError as error:
        if "Dlpack not installed" in str(error):
            raise RuntimeError(f"{where}: {DLPACK_MISSING}") from error
        raise
    # Not from_dlpack(copy=True): JAX 0.10.2 returns an alias on CPU even then (test_dali.py).
    return jnp.array(alias, copy=True)


@contextlib.contextmanager
def _rocal_chatter_hidden(said: list):
    """Runs the block with stdout (Python's and fd 1) caught into ``said``; every line but ``ROCAL_CHATTER`` is printed
    once the block has ended, so rocAL's errors are never lost."""
    sys.stdout.flush()
    saved = os.dup(1)
    text = ""
    try:
        with tempfile.TemporaryFile() as sink, contextlib.redirect_stdout(io.StringIO()) as python:
            os.dup2(sink.fileno(), 1)
            try:
                yield
            finally:
                ctypes.CDLL(None).fflush(None)  # rocAL's C++ output still in the C library's buffer
                os.dup2(saved, 1)
                sink.seek(0)
                text = python.getvalue() + sink.read().decode(errors="replace")
                said.append(text)
    finally:
        os.close(saved)
        rest = [line for line in text.splitlines() if line.strip() and not line.startswith(ROCAL_CHATTER)]
        if rest:  # after redirect_stdout has ended: to the real stdout
            print("\n".join(rest), flush=True)


def _call(where: str, what: str, fn):
    """``fn()``, with any error re-raised naming the shard, the step and the call."""
    try:
        return fn()
    except Exception as error:
        raise RuntimeError(f"{where}: {what} raised {type(error).__name__}: {str(error).strip()}") from error
