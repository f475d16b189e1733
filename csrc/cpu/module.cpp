// Python module entry for compress._C. Importing it runs the static
// TORCH_LIBRARY_IMPL registrations of every kernel file in csrc/cpu/.
#include <Python.h>

static struct PyModuleDef compress_c_module = {PyModuleDef_HEAD_INIT, "_C", "compress CPU kernels", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&compress_c_module); }
