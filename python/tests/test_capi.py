"""test_capi.py - the ctypes bindings match include/comet.h: every struct's
size and every field's offset equal the C compiler's (a tiny C program built
from the header), the library accepts the struct_size each binding sends and
rejects a wrong one, every function of comet.h has a prototype, and the
initializers equal the header's."""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

import comet
from comet import _capi

from conftest import ROOT

HEADER = os.path.join(ROOT, "include", "comet.h")


def c_layout(tmp_path):
    """({struct: (sizeof, {field: offsetof})}, {struct: {field: value of its
    COMET_*_INIT}}) as the C compiler lays comet.h out."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc or not os.path.exists(HEADER):
        pytest.skip("no C compiler or no include/comet.h here: cannot compare with C")
    lines = ["#include <stddef.h>", "#include <stdint.h>", "#include <stdio.h>", "#include \"comet.h\"", "int main(void) {"]
    for name, cls in _capi.STRUCTS.items():
        lines.append('    printf("%s sizeof %%zu\\n", sizeof(%s));' % (name, name))
        for field, _ in cls._fields_:
            lines.append('    printf("%s %s %%zu\\n", offsetof(%s, %s));' % (name, field, name, field))
    scalars = (ctypes.c_int, ctypes.c_uint32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p)
    for name, cls in _capi.STRUCTS.items():
        if not hasattr(cls, "init"):
            continue
        lines.append("    { %s v = %s;" % (name, name[:-2].upper() + "_INIT"))  # COMET_LAYER_CONFIG_INIT, ...
        for field, ftype in cls._fields_:
            if ftype in scalars:
                lines.append('      printf("init %s %s %%lld\\n", (long long)(intptr_t)v.%s);' % (name, field, field))
        lines.append("    }")
    lines += ["    return 0;", "}"]
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c11", "-I", os.path.dirname(HEADER), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout, init = {}, {}
    for line in out.splitlines():
        if line.startswith("init "):
            _, struct, field, value = line.split()
            init.setdefault(struct, {})[field] = int(value)
            continue
        struct, field, value = line.split()
        size, fields = layout.setdefault(struct, (None, {}))
        if field == "sizeof":
            layout[struct] = (int(value), fields)
        else:
            fields[field] = int(value)
    return layout, init


def test_struct_layout_matches_c(tmp_path):
    layout, _ = c_layout(tmp_path)
    for name, cls in _capi.STRUCTS.items():
        size, offsets = layout[name]
        assert ctypes.sizeof(cls) == size, name
        for field, _ in cls._fields_:
            assert getattr(cls, field).offset == offsets[field], "%s.%s" % (name, field)


def test_library_accepts_the_struct_sizes():
    # comet_layer_config_t and comet_world_options_t: accepted as initialized, rejected one byte off
    cfg = comet.LayerConfig(hidden=8, ffn=8, num_experts=2, topk=1, max_tokens_per_rank=4).to_c()
    assert _capi.comet_layer_config_check(ctypes.byref(cfg), 1) == 0
    cfg.struct_size += 1
    assert _capi.comet_layer_config_check(ctypes.byref(cfg), 1) == comet.Status.INVALID_ARGUMENT
    assert b"struct_size" in _capi.comet_last_error()

    world = ctypes.c_void_p()
    opts = _capi.comet_world_options_t.init()
    opts.struct_size -= 8
    assert _capi.comet_world_create_local_opts(ctypes.byref(world), 1, 0, ctypes.byref(opts)) != 0
    assert b"struct_size" in _capi.comet_last_error()
    with comet.World(1) as w:
        # comet_world_options_t out, comet_protocol_t out, comet_forward_args_t in
        assert w.options.cpu_workers >= 1
        out = _capi.comet_world_options_t.init()
        out.struct_size = 4
        assert _capi.comet_world_get_options(w._handle, ctypes.byref(out)) == comet.Status.INVALID_ARGUMENT
        cfg = comet.LayerConfig(hidden=8, ffn=8, num_experts=2, topk=1, max_tokens_per_rank=4)
        with w.layer(0, cfg) as layer:
            args = _capi.comet_forward_args_t.init()
            args.struct_size += 8
            assert _capi.comet_layer_forward(layer._handle, ctypes.byref(args)) == comet.Status.INVALID_ARGUMENT
            assert b"args.struct_size" in _capi.comet_last_error()
            proto = _capi.comet_protocol_t.init()
            proto.struct_size = 0
            assert _capi.comet_layer_last_protocol(layer._handle, ctypes.byref(proto)) != 0
    # comet_backward_args_t: the reference reads its struct_size first
    bad = (_capi.comet_backward_args_t * 1)()
    bad[0].struct_size = ctypes.sizeof(_capi.comet_backward_args_t) + 4
    assert _capi.comet_reference_backward(ctypes.byref(cfg.to_c()), 1, bad) == comet.Status.INVALID_ARGUMENT
    assert b"struct_size" in _capi.comet_last_error()


def test_tensor_constructors_match():
    t = _capi.comet_tensor_3d(1234, _capi.DTYPE_BF16, 3, 5, 7)
    assert (t.data, t.dtype, t.ndim, list(t.shape)) == (1234, _capi.DTYPE_BF16, 3, [3, 5, 7, 0])
    mine = comet.TensorDesc(1234, "bf16", (3, 5, 7)).to_c()
    assert bytes(mine) == bytes(t)
    t2 = _capi.comet_tensor_2d(None, _capi.DTYPE_FP32, 2, 9)
    assert bytes(comet.TensorDesc(0, comet.DType.FP32, (2, 9)).to_c()) == bytes(t2)


def test_every_function_of_the_header_is_bound():
    if not os.path.exists(HEADER):
        pytest.skip("no include/comet.h here")
    text = re.sub(r"/\*.*?\*/", "", open(HEADER).read(), flags=re.S)
    declared = set(re.findall(r"\b(comet_[a-z0-9_]+)\s*\(", text))
    assert declared, "no function found in comet.h"
    missing = sorted(n for n in declared if not hasattr(_capi, n))
    assert not missing, "comet.h functions without a binding: %s" % missing


def test_initializers_match_the_header(tmp_path):
    # each binding's init() equals the header's COMET_*_INIT, field by field
    # (struct_size included), as the C compiler evaluates it
    _, values = c_layout(tmp_path)
    for name, cls in _capi.STRUCTS.items():
        if not hasattr(cls, "init"):
            continue
        mine = cls.init()
        for field, ftype in cls._fields_:
            if field in values.get(name, {}):
                got = getattr(mine, field)
                assert (got or 0) == values[name][field], "%s.%s" % (name, field)
        assert mine.struct_size == ctypes.sizeof(cls), name
    assert values["comet_layer_config_t"]["tp"] == 1  # the header's defaults were read
    assert ctypes.sizeof(_capi.comet_unique_id_t) == _capi.COMET_UNIQUE_ID_BYTES
