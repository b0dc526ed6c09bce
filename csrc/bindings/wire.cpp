// The dock's same-node wire encoding (msrl_core.dock._wire), native: one pass over the value on each
// side of a round trip instead of a Python call per item. The format is the module doc's: a tagged
// encoding that can only build None, bools, 64-bit ints and floats, UTF-8 strings, lists and 1-D arrays
// of five dtypes (raw bytes). Decoding never runs code, checks every length against the bytes left
// before it allocates, and refuses trailing bytes and nesting deeper than kMaxDepth.
// Also the dock's per-row packing of a ragged put (a list of row arrays -> one packed array + lengths).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "common/thread_pool.h"

namespace msrl::bindings {

namespace {

constexpr int kMaxDepth = 8;

// The wire's array dtypes, by code: <i8, <i4, u1, <f8, <u8 (numpy kind, item size).
struct WireDType {
  char kind;
  int size;
};
constexpr WireDType kDTypes[] = {{'i', 8}, {'i', 4}, {'u', 1}, {'f', 8}, {'u', 8}};
constexpr int kNumDTypes = 5;

struct WireFormat : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct NumpyTypes {
  py::handle bool_, integer, floating, ndarray;
};

const NumpyTypes& numpy_types() {
  // Leaked on purpose: looked up once, alive as long as numpy (the interpreter) is.
  static const NumpyTypes t = [] {
    py::module_ np = py::module_::import("numpy");
    auto get = [&np](const char* name) { return py::object(np.attr(name)).release(); };
    return NumpyTypes{get("bool_"), get("integer"), get("floating"), get("ndarray")};
  }();
  return t;
}

bool is_instance(PyObject* v, py::handle type) {
  const int r = PyObject_IsInstance(v, type.ptr());
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

void put_be(std::string& out, uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

int array_code(const py::array& a) {
  const py::dtype dt = a.dtype();
  const char order = dt.byteorder();
  if (order == '>') return -1;
  for (int c = 0; c < kNumDTypes; ++c) {
    if (dt.kind() == kDTypes[c].kind && dt.itemsize() == kDTypes[c].size) return c;
  }
  return -1;
}

void encode_value(PyObject* v, std::string& out, int depth) {
  if (depth > kMaxDepth) throw WireFormat("value nested deeper than " + std::to_string(kMaxDepth));
  const NumpyTypes& np = numpy_types();
  if (v == Py_None) {
    out.push_back('N');
  } else if (v == Py_True || v == Py_False || is_instance(v, np.bool_)) {
    const int truth = PyObject_IsTrue(v);
    if (truth < 0) throw py::error_already_set();
    out.push_back(truth ? 'T' : 'F');
  } else if (PyLong_Check(v) || is_instance(v, np.integer)) {
    py::int_ as_int = py::reinterpret_steal<py::int_>(PyNumber_Index(v));
    if (!as_int) throw py::error_already_set();
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(as_int.ptr(), &overflow);
    if (overflow) throw WireFormat("an int outside the 64-bit signed range cannot travel on the dock wire");
    if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
    out.push_back('i');
    put_be(out, static_cast<uint64_t>(x), 8);
  } else if (PyFloat_Check(v) || is_instance(v, np.floating)) {
    const double d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    uint64_t bits = 0;
    std::memcpy(&bits, &d, 8);
    out.push_back('f');
    put_be(out, bits, 8);
  } else if (PyUnicode_Check(v)) {
    Py_ssize_t n = 0;
    const char* s = PyUnicode_AsUTF8AndSize(v, &n);
    if (s == nullptr) throw py::error_already_set();
    if (static_cast<uint64_t>(n) > 0xffffffffull) throw WireFormat("string longer than 4 GiB");
    out.push_back('s');
    put_be(out, static_cast<uint64_t>(n), 4);
    out.append(s, static_cast<size_t>(n));
  } else if (PyList_Check(v) || PyTuple_Check(v)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    out.push_back('l');
    put_be(out, static_cast<uint64_t>(n), 4);
    PyObject** items = PySequence_Fast_ITEMS(v);
    for (Py_ssize_t i = 0; i < n; ++i) encode_value(items[i], out, depth + 1);
  } else if (is_instance(v, np.ndarray)) {
    py::array a = py::reinterpret_borrow<py::array>(v);
    const int code = array_code(a);
    if (code < 0 || a.ndim() != 1) {
      throw WireFormat("array of dtype " + std::string(py::str(a.dtype())) + " and " + std::to_string(a.ndim()) +
                       " dims cannot travel; 1-D int64, int32, uint8, float64 or uint64");
    }
    py::array c = py::array::ensure(a, py::array::c_style);
    if (!c) throw py::error_already_set();
    out.push_back('a');
    out.push_back(static_cast<char>(code));
    put_be(out, static_cast<uint64_t>(c.size()), 8);
    out.append(static_cast<const char*>(c.data()), static_cast<size_t>(c.nbytes()));
  } else {
    throw WireFormat("a " + std::string(Py_TYPE(v)->tp_name) + " cannot travel on the dock wire");
  }
}

struct Reader {
  const uint8_t* p;
  size_t n;
  size_t pos = 0;

  size_t take(uint64_t k) {
    if (k > n - pos) throw WireFormat("frame ends inside a value");
    const size_t at = pos;
    pos += static_cast<size_t>(k);
    return at;
  }
  uint64_t be(int bytes) {
    const size_t at = take(static_cast<uint64_t>(bytes));
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v = (v << 8) | p[at + static_cast<size_t>(i)];
    return v;
  }
};

py::object decode_value(Reader& r, int depth) {
  if (depth > kMaxDepth) throw WireFormat("value nested deeper than " + std::to_string(kMaxDepth));
  const char tag = static_cast<char>(r.p[r.take(1)]);
  switch (tag) {
    case 'N': return py::none();
    case 'T': return py::bool_(true);
    case 'F': return py::bool_(false);
    case 'i': return py::reinterpret_steal<py::object>(PyLong_FromLongLong(static_cast<long long>(r.be(8))));
    case 'f': {
      const uint64_t bits = r.be(8);
      double d = 0;
      std::memcpy(&d, &bits, 8);
      return py::float_(d);
    }
    case 's': {
      const uint64_t k = r.be(4);
      const size_t at = r.take(k);
      PyObject* s = PyUnicode_DecodeUTF8(reinterpret_cast<const char*>(r.p + at), static_cast<Py_ssize_t>(k), "strict");
      if (s == nullptr) {
        PyErr_Clear();
        throw WireFormat("string is not UTF-8");
      }
      return py::reinterpret_steal<py::object>(s);
    }
    case 'l': {
      const uint64_t k = r.be(4);
      if (k > r.n - r.pos) throw WireFormat("frame ends inside a value");  // an item takes a byte at least
      py::list items(static_cast<size_t>(k));
      for (uint64_t i = 0; i < k; ++i) {
        py::object x = decode_value(r, depth + 1);
        PyList_SET_ITEM(items.ptr(), static_cast<Py_ssize_t>(i), x.release().ptr());
      }
      return std::move(items);
    }
    case 'a': {
      const size_t code = r.p[r.take(1)];
      const uint64_t count = r.be(8);
      if (code >= kNumDTypes) throw WireFormat("unknown array dtype code " + std::to_string(code));
      if (count > r.n) throw WireFormat("array longer than the frame");  // before multiplying
      const uint64_t nbytes = count * static_cast<uint64_t>(kDTypes[code].size);
      const size_t at = r.take(nbytes);
      const char name[] = {'<', kDTypes[code].kind, static_cast<char>('0' + kDTypes[code].size), 0};
      py::array out(py::dtype(kDTypes[code].size == 1 ? std::string("u1") : std::string(name)),
                    std::vector<py::ssize_t>{static_cast<py::ssize_t>(count)});
      if (nbytes) std::memcpy(out.mutable_data(), r.p + at, static_cast<size_t>(nbytes));
      return std::move(out);
    }
    default: throw WireFormat(std::string("unknown tag ") + py::repr(py::bytes(&tag, 1)).cast<std::string>());
  }
}

// One ragged column's rows (numpy arrays of exactly `dtype`, C-contiguous, inner shape `inner`) packed
// back to back: (values [total, *inner], lengths). None when a row is anything else (the Python path
// then converts it, or names what is wrong).
py::object pack_rows(const py::list& rows, const py::dtype& dtype, const std::vector<int64_t>& inner) {
  const size_t n = rows.size();
  if (n == 0) return py::none();
  const NumpyTypes& np = numpy_types();
  std::vector<py::array> arrays;
  arrays.reserve(n);
  py::array_t<int64_t> lengths(static_cast<py::ssize_t>(n));
  int64_t* len = lengths.mutable_data();
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(rows.ptr(), static_cast<Py_ssize_t>(i));
    if (!is_instance(item, np.ndarray)) return py::none();
    py::array a = py::reinterpret_borrow<py::array>(item);
    const py::dtype dt = a.dtype();
    if (dt.kind() != dtype.kind() || dt.itemsize() != dtype.itemsize() || dt.byteorder() == '>' ||
        !(a.flags() & py::array::c_style) || a.ndim() != static_cast<py::ssize_t>(1 + inner.size())) {
      return py::none();
    }
    for (size_t d = 0; d < inner.size(); ++d) {
      if (a.shape(static_cast<py::ssize_t>(d + 1)) != inner[d]) return py::none();
    }
    len[i] = a.shape(0);
    total += len[i];
    arrays.push_back(std::move(a));
  }
  std::vector<py::ssize_t> shape{static_cast<py::ssize_t>(total)};
  shape.insert(shape.end(), inner.begin(), inner.end());
  py::array out(dtype, shape);
  std::vector<Segment> segs;
  segs.reserve(n);
  auto* dst = static_cast<uint8_t*>(out.mutable_data());
  size_t off = 0;
  for (const py::array& a : arrays) {
    const auto nb = static_cast<size_t>(a.nbytes());
    if (nb) segs.push_back({dst + off, static_cast<const uint8_t*>(a.data()), nb});
    off += nb;
  }
  {
    py::gil_scoped_release release;
    copy_segments(std::move(segs));
  }
  return py::make_tuple(std::move(out), std::move(lengths));
}

}  // namespace

void bind_wire(py::module_& m) {
  py::register_exception<WireFormat>(m, "DockWireError", PyExc_Exception);
  m.def(
      "dock_wire_encode",
      [](py::handle value) {
        std::string out;
        encode_value(value.ptr(), out, 0);
        return py::bytes(out);
      },
      "The dock wire's body bytes of a value (msrl_core.dock._wire); DockWireError for what cannot travel.");
  m.def(
      "dock_wire_decode",
      [](py::buffer body) {
        py::buffer_info info = body.request();
        Reader r{static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
        py::object v = decode_value(r, 0);
        if (r.pos != r.n) throw WireFormat(std::to_string(r.n - r.pos) + " trailing bytes after the value");
        return v;
      },
      "The value of a dock wire body; DockWireError on anything that does not follow the encoding exactly.");
  m.def("dock_pack_rows", &pack_rows, py::arg("rows"), py::arg("dtype"), py::arg("inner"),
        "A ragged column's row arrays packed back to back: (values, lengths); None when a row is not a "
        "C-contiguous array of exactly that dtype and inner shape (the caller converts it).");
}

}  // namespace msrl::bindings
