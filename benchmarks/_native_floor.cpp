// The core restore of benchmarks/python_floor.py, per slot in C++: what a native executor would pay.
//
// Built by benchmarks/native_floor.py (setuptools, no ninja). Not part of the package: a measurement of the
// native route, with the same checks as the pure-Python floor: per slot a lookup in the owner's
// attribute dict, an identity check, a storage comparison, the layout of the new and of the captured tensor
// against the sealed one, a reference-count look; one grouped _foreach_copy_; the rebind; a verification.
#include <torch/extension.h>

#include <Python.h>

#include <vector>

namespace {

struct Sealed {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset;
  at::ScalarType dtype;
  at::Device device;
  const void* data;
};

std::vector<Sealed> g_sealed;

bool same_layout(const at::Tensor& t, const Sealed& s) {
  return t.sizes().equals(s.sizes) && t.strides().equals(s.strides) && t.storage_offset() == s.offset &&
         t.scalar_type() == s.dtype && t.device() == s.device && !t.is_conj() && !t.is_neg();
}

// Record what the seal saw of each captured tensor.
void seal(py::list captured) {
  g_sealed.clear();
  for (auto item : captured) {
    const at::Tensor& t = THPVariable_Unpack(item.ptr());
    g_sealed.push_back(Sealed{t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type(), t.device(),
                              t.const_data_ptr()});
  }
}

// One restore: owners[i] is the attribute dict holding slot i under keys[i]; captured[i] its captured tensor.
// Returns the number of slots copied; raises on anything the floor does not expect.
int64_t restore(py::list owners, py::list keys, py::list captured) {
  const Py_ssize_t n = PyList_GET_SIZE(owners.ptr());
  std::vector<at::Tensor> dsts, srcs;
  dsts.reserve(n);
  srcs.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* dict = PyList_GET_ITEM(owners.ptr(), i);
    PyObject* key = PyList_GET_ITEM(keys.ptr(), i);
    PyObject* old = PyList_GET_ITEM(captured.ptr(), i);
    PyObject* current = PyDict_GetItemWithError(dict, key);
    if (current == nullptr) throw std::runtime_error("native floor: path does not resolve");
    if (current == old) continue;
    if (!THPVariable_Check(current)) throw std::runtime_error("native floor: not a tensor");
    const at::Tensor& now = THPVariable_Unpack(current);
    const at::Tensor& dst = THPVariable_Unpack(old);
    const Sealed& s = g_sealed[i];
    if (now.storage().unsafeGetStorageImpl() == dst.storage().unsafeGetStorageImpl())
      throw std::runtime_error("native floor: unexpected in-place slot");
    if (!same_layout(now, s) || !same_layout(dst, s) || dst.const_data_ptr() != s.data)
      throw std::runtime_error("native floor: unexpected layout");
    // The list's reference, the caller's and the sealed one: anything more is a holder to look for.
    if (Py_REFCNT(old) > 8) throw std::runtime_error("native floor: unexpected holder");
    dsts.push_back(dst);
    srcs.push_back(now);
  }
  {
    at::NoGradGuard no_grad;
    if (!dsts.empty()) at::_foreach_copy_(dsts, srcs);
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyDict_SetItem(PyList_GET_ITEM(owners.ptr(), i), PyList_GET_ITEM(keys.ptr(), i),
                       PyList_GET_ITEM(captured.ptr(), i)) != 0)
      throw py::error_already_set();
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* current = PyDict_GetItemWithError(PyList_GET_ITEM(owners.ptr(), i), PyList_GET_ITEM(keys.ptr(), i));
    if (current != PyList_GET_ITEM(captured.ptr(), i)) throw std::runtime_error("native floor: verification failed");
    const at::Tensor& t = THPVariable_Unpack(current);
    if (t.const_data_ptr() != g_sealed[i].data || !same_layout(t, g_sealed[i]))
      throw std::runtime_error("native floor: verification failed");
  }
  return static_cast<int64_t>(dsts.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("seal", &seal);
  m.def("restore", &restore);
}
