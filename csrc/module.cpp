// The Python module vtoken._C.
//
// It has no Python-level attributes: loading the shared library runs the
// TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL registrations of every
// csrc/*_binding.cpp, which makes the ops available as torch.ops.vtoken.*.
// Nothing here (or in any registration) calls CUDA, so the import works on a
// machine without a GPU or driver.
#include <Python.h>

static struct PyModuleDef vtoken_c_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "vtoken's compiled ops; use them through vtoken.device.ops or torch.ops.vtoken.",
    -1,
    nullptr,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&vtoken_c_module); }
