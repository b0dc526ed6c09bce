// Transfer dock: DockCore (the control plane of both backends, with the local backend's warehouses) and
// Warehouse (a Ray warehouse actor's byte store).
// Arguments are validated with the GIL held; puts, fetches and blocking claims run without it.
#include "dock/dock.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>

#include "bindings/bindings.h"
#include "common/error.h"

namespace msrl::bindings {

namespace {

using dock::ColumnInput;
using dock::ColumnSpec;
using dock::DType;

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

using dock::parse_dtype;

// (name, dtype, ragged, inner_shape, arena_bytes, growable, label)
using ColumnTuple = std::tuple<std::string, std::string, bool, std::vector<int64_t>, int64_t, bool, std::string>;

ColumnSpec parse_column(const ColumnTuple& col) {
  const auto& [name, dtype, ragged, shape, arena, growable, label] = col;
  ColumnSpec spec;
  spec.name = name;
  spec.dtype = parse_dtype(dtype);
  spec.ragged = ragged;
  spec.inner_shape = shape;
  spec.arena_bytes = arena;
  spec.growable = growable;
  spec.label = label == dtype ? std::string() : label;
  return spec;
}

ColumnTuple column_tuple(const ColumnSpec& c) {
  return {c.name,
          dock::dtype_name(c.dtype),
          c.ragged,
          c.inner_shape,
          c.arena_bytes,
          c.growable,
          c.label.empty() ? std::string(dock::dtype_name(c.dtype)) : c.label};
}

std::vector<ColumnSpec> parse_columns(const std::vector<ColumnTuple>& cols) {
  std::vector<ColumnSpec> out;
  for (const auto& c : cols) out.push_back(parse_column(c));
  return out;
}

// Keys: a str or an int (numpy integers too; bool is refused), encoded 'i' + decimal or 's' + UTF-8 so
// that 1 and "1" are distinct keys natively.
std::vector<std::string> encode_keys(const py::sequence& keys) {
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(keys.size()));
  for (const py::handle& k : keys) {
    if (py::isinstance<py::str>(k)) {
      out.push_back("s" + k.cast<std::string>());
    } else if (!py::isinstance<py::bool_>(k) && (py::isinstance<py::int_>(k) || py::hasattr(k, "__index__"))) {
      out.push_back("i" + py::str(py::int_(py::reinterpret_borrow<py::object>(k))).cast<std::string>());
    } else {
      MSRL_THROW(kInvalidArgument, "keys must be str or int, got ", py::str(py::type::of(k)).cast<std::string>(), " (",
                 py::repr(k).cast<std::string>(), ")");
    }
  }
  return out;
}

py::object decode_key(const std::string& k) {
  if (!k.empty() && k[0] == 'i') return py::int_(py::str(k.substr(1)));
  return py::str(k.substr(1));
}

py::list decode_keys(const std::vector<std::string>& keys) {
  py::list out;
  for (const std::string& k : keys) out.append(decode_key(k));
  return out;
}

// Tags: one list of (name, JSON text) pairs per key.
std::vector<dock::Tags> parse_tags(const py::object& tags) {
  std::vector<dock::Tags> out;
  if (tags.is_none()) return out;
  for (const py::handle& per_key : tags.cast<py::sequence>()) {
    dock::Tags t;
    for (const py::handle& item : per_key.cast<py::sequence>()) {
      py::sequence pair = item.cast<py::sequence>();
      MSRL_CHECK(pair.size() == 2, kInvalidArgument, "a tag is a (name, JSON text) pair");
      t.emplace_back(pair[0].cast<std::string>(), pair[1].cast<std::string>());
    }
    out.push_back(std::move(t));
  }
  return out;
}

py::list tags_list(const std::vector<dock::Tags>& tags) {
  py::list out;
  for (const dock::Tags& t : tags) {
    py::list items;
    for (const auto& [name, value] : t) items.append(py::make_tuple(name, value));
    out.append(items);
  }
  return out;
}

std::vector<dock::ColumnMark> parse_marks(const py::sequence& cols, size_t n, std::vector<I64Array>& keep) {
  std::vector<dock::ColumnMark> marks;
  keep.reserve(static_cast<size_t>(cols.size()));
  for (const py::handle& h : cols) {
    py::sequence t = h.cast<py::sequence>();  // type-checked (a tuple or list)
    MSRL_CHECK(t.size() == 2, kInvalidArgument, "publish expects (column_id, lengths or None) pairs");
    dock::ColumnMark m{t[0].cast<int>(), nullptr};
    if (!t[1].is_none()) {
      keep.push_back(t[1].cast<I64Array>());
      MSRL_CHECK(static_cast<size_t>(keep.back().size()) == n, kInvalidArgument, "publish: ", keep.back().size(),
                 " lengths for ", n, " rows");
      m.lengths = keep.back().data();
    }
    marks.push_back(m);
  }
  return marks;
}

// A read-only C-contiguous buffer: pointer and size, with the GIL held.
struct Bytes {
  const void* ptr = nullptr;
  size_t nbytes = 0;
};

Bytes bytes_of(const py::buffer& b, const char* what) {
  py::buffer_info info = b.request();
  // C-contiguity: strides must be the packed ones.
  ssize_t expect = info.itemsize;
  for (ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expect) {
      MSRL_THROW(kInvalidArgument, what, ": values must be C-contiguous (use numpy.ascontiguousarray)");
    }
    expect *= info.shape[d];
  }
  return Bytes{info.ptr, static_cast<size_t>(info.size * info.itemsize)};
}

void* writable_ptr(py::buffer& b, size_t* nbytes) {
  py::buffer_info info = b.request(true);
  ssize_t expect = info.itemsize;
  for (ssize_t d = info.ndim - 1; d >= 0; --d) {
    MSRL_CHECK(info.shape[d] == 1 || info.strides[d] == expect, kInvalidArgument, "output buffer must be C-contiguous");
    expect *= info.shape[d];
  }
  *nbytes = static_cast<size_t>(info.size * info.itemsize);
  return info.ptr;
}

py::array_t<int64_t> to_array(std::vector<int64_t>&& v) {
  py::array_t<int64_t> a(static_cast<ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(int64_t));
  return a;
}

// Inputs of a put into n rows: list of (column id, values buffer, lengths array (n) or None). Keeps the
// Python objects alive in `keep` while the GIL is released.
std::vector<ColumnInput> parse_inputs(const py::sequence& cols, size_t n, std::vector<py::object>& keep) {
  std::vector<ColumnInput> inputs;
  for (const py::handle& h : cols) {
    py::sequence t = h.cast<py::sequence>();  // type-checked (a tuple or list)
    MSRL_CHECK(t.size() == 3, kInvalidArgument, "put expects (column_id, values, lengths) tuples");
    ColumnInput in;
    in.column = t[0].cast<int>();
    py::buffer values = t[1].cast<py::buffer>();
    Bytes b = bytes_of(values, "put");
    in.data = b.ptr;
    in.nbytes = b.nbytes;
    keep.push_back(values);
    if (!t[2].is_none()) {
      I64Array lens = t[2].cast<I64Array>();
      MSRL_CHECK(static_cast<size_t>(lens.size()) == n, kInvalidArgument, "put: ", lens.size(), " lengths for ", n,
                 " rows");
      in.lengths = lens.data();
      keep.push_back(lens);
    }
    inputs.push_back(in);
  }
  return inputs;
}

py::dict op_stats(const dock::OpStats& s) {
  py::dict d;
  d["count"] = s.count.load();
  d["rows"] = s.rows.load();
  d["bytes"] = s.bytes.load();
  d["total_s"] = s.total_ns.load() * 1e-9;
  d["max_s"] = s.max_ns.load() * 1e-9;
  return d;
}

py::dict stats_dict(const dock::ColumnStats& st) {
  py::dict x;
  x["rows_written"] = st.rows_written;
  x["bytes_used"] = st.bytes_used;
  x["arena_bytes"] = st.arena_bytes;
  x["chunks"] = st.chunks;
  return x;
}

py::dict progress_dict(const dock::StageProgress& p) {
  py::dict d;
  d["ready_rows"] = p.ready_rows;
  d["consumed_rows"] = p.consumed_rows;
  d["waiting_claims"] = p.waiting_claims;
  return d;
}

// A pinned zero-copy span of one warehouse arena. Exposes the bytes read-only through the buffer
// protocol, so numpy arrays made from it keep it alive; when the last one goes it unpins: through the
// DockCore (local backend, DockCore::view) or by dropping `owner` (Ray backend: the owner is the client's
// pin of a shared arena, which unpins in the warehouse when it goes).
class DockView {
 public:
  DockView(py::object owner, dock::DockCore* core, const uint8_t* data, size_t nbytes)
      : owner_(std::move(owner)), core_(core), data_(data), nbytes_(nbytes) {}
  DockView(const DockView&) = delete;
  DockView& operator=(const DockView&) = delete;
  ~DockView() {
    if (core_ != nullptr) core_->unpin();
  }
  const uint8_t* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }

 private:
  py::object owner_;  // keeps the DockCore alive
  dock::DockCore* core_;
  const uint8_t* data_;
  size_t nbytes_;
};

}  // namespace

// The keyed store: partitions, keys, field updates, erase, tags, run-time columns, DP claims.
void bind_dock_keys(py::class_<dock::DockCore>& core) {
  using dock::DockCore;
  core.def(
          "partition", [](DockCore& d, const std::string& name, bool create) { return d.partition(name, create); },
          py::arg("name"), py::arg("create") = true, "The id of a partition ('' = the default one).")
      .def("partition_names", &DockCore::partition_names)
      .def("partition_epoch", &DockCore::partition_epoch)
      .def("check_claim_epoch", &DockCore::check_claim_epoch, py::arg("p"), py::arg("epoch"))
      .def_property_readonly("num_columns", &DockCore::num_columns)
      .def(
          "declare_column", [](DockCore& d, const ColumnTuple& col) { return d.declare_column(parse_column(col)); },
          py::arg("column"), "Declares a run-time column (or checks an existing one): its id.")
      .def(
          "column_declared", [](const DockCore& d, int c) { return d.column(c).declared; }, py::arg("column"))
      .def(
          "column_info",
          [](const DockCore& d, const std::string& name) -> py::object {
            const int n = d.num_columns();
            for (int c = 0; c < n; ++c) {
              const ColumnSpec& spec = d.column(c);
              if (spec.name == name) return py::make_tuple(c, column_tuple(spec), spec.declared);
            }
            return py::none();
          },
          py::arg("name"), "(id, column tuple, declared) of a column, or None when there is none of that name.")
      .def(
          "put_keys",
          [](DockCore& d, int p, const py::sequence& keys, const py::sequence& cols, bool overwrite,
             const py::object& tags, const std::vector<int64_t>& versions) {
            std::vector<std::string> ks = encode_keys(keys);
            std::vector<py::object> keep;
            std::vector<ColumnInput> inputs = parse_inputs(cols, ks.size(), keep);
            std::vector<dock::Tags> tg = parse_tags(tags);
            std::vector<int64_t> rows;
            {
              py::gil_scoped_release release;
              rows = d.put_keys(p, ks, inputs, overwrite, tg, versions);
            }
            return to_array(std::move(rows));
          },
          py::arg("partition"), py::arg("keys"), py::arg("columns"), py::arg("overwrite") = false,
          py::arg("tags") = py::none(), py::arg("versions") = std::vector<int64_t>{})
      .def(
          "begin_put_keys",
          [](DockCore& d, int p, const py::sequence& keys, const std::vector<int>& columns, bool overwrite) {
            std::vector<std::string> ks = encode_keys(keys);
            dock::KeyedPut kp;
            {
              py::gil_scoped_release release;
              kp = d.begin_put_keys(p, ks, columns, overwrite);
            }
            return py::make_tuple(kp.put, to_array(std::move(kp.rows)),
                                  py::array_t<bool>(static_cast<ssize_t>(kp.fresh.size()),
                                                    reinterpret_cast<const bool*>(kp.fresh.data())),
                                  kp.put_epoch, kp.rewrites);
          },
          py::arg("partition"), py::arg("keys"), py::arg("columns"), py::arg("overwrite") = false,
          "(put id, rows, fresh, iteration, rewrites): a keyed put begun (new keys pending).")
      .def(
          "publish_keys",
          [](DockCore& d, uint64_t put, const I64Array& rows, int p, const py::sequence& cols, const py::object& tags,
             const std::vector<int64_t>& versions) {
            dock::KeyedPut kp;
            kp.put = put;
            kp.rows.assign(rows.data(), rows.data() + rows.size());
            std::vector<I64Array> keep;
            std::vector<dock::ColumnMark> marks = parse_marks(cols, kp.rows.size(), keep);
            std::vector<dock::Tags> tg = parse_tags(tags);
            py::gil_scoped_release release;
            d.publish_keys(kp, p, marks, tg, versions);
          },
          py::arg("put"), py::arg("rows"), py::arg("partition"), py::arg("columns"), py::arg("tags") = py::none(),
          py::arg("versions") = std::vector<int64_t>{})
      .def(
          "rows_of",
          [](const DockCore& d, int p, const py::sequence& keys) { return to_array(d.rows_of(p, encode_keys(keys))); },
          py::arg("partition"), py::arg("keys"))
      .def(
          "keys_of",
          [](const DockCore& d, int p, const I64Array& rows) {
            return decode_keys(d.keys_of(p, rows.data(), static_cast<size_t>(rows.size())));
          },
          py::arg("partition"), py::arg("rows"))
      .def(
          "list_keys",
          [](const DockCore& d, int p) {
            dock::KeyListing l = d.list_keys(p);
            return py::make_tuple(decode_keys(l.keys), to_array(std::move(l.rows)), tags_list(l.tags));
          },
          py::arg("partition"), "(keys, rows, tags as (name, JSON) pairs) in row order.")
      .def(
          "written",
          [](const DockCore& d, int p, const py::sequence& keys, const std::vector<int>& columns) {
            std::vector<uint8_t> w = d.written(p, encode_keys(keys), columns);
            py::array_t<bool> out({static_cast<ssize_t>(keys.size()), static_cast<ssize_t>(columns.size())});
            if (!w.empty()) std::memcpy(out.mutable_data(), w.data(), w.size());
            return out;
          },
          py::arg("partition"), py::arg("keys"), py::arg("columns"))
      .def("cell_written", &DockCore::cell_written, py::arg("column"), py::arg("row"))
      .def(
          "tag",
          [](DockCore& d, int p, const py::sequence& keys, const py::object& tags) {
            std::vector<std::string> ks = encode_keys(keys);
            std::vector<dock::Tags> tg = parse_tags(tags);
            py::gil_scoped_release release;
            d.tag(p, ks, tg);
          },
          py::arg("partition"), py::arg("keys"), py::arg("tags"))
      .def(
          "begin_erase_keys",
          [](DockCore& d, int p, const py::sequence& keys) {
            std::vector<std::string> ks = encode_keys(keys);
            std::vector<int64_t> rows;
            {
              py::gil_scoped_release release;
              rows = d.begin_erase_keys(p, ks);
            }
            return to_array(std::move(rows));
          },
          py::arg("partition"), py::arg("keys"))
      .def(
          "begin_erase_rows",
          [](DockCore& d, int p, const I64Array& rows) {
            std::vector<int64_t> out;
            {
              py::gil_scoped_release release;
              out = d.begin_erase_rows(p, rows.data(), static_cast<size_t>(rows.size()));
            }
            return to_array(std::move(out));
          },
          py::arg("partition"), py::arg("rows"))
      .def(
          "begin_clear",
          [](DockCore& d, int p) {
            std::vector<int64_t> out;
            {
              py::gil_scoped_release release;
              out = d.begin_clear(p);
            }
            return to_array(std::move(out));
          },
          py::arg("partition"))
      .def(
          "end_erase", [](DockCore& d, const std::vector<int64_t>& rows) { d.end_erase(rows); }, py::arg("rows"))
      .def(
          "erase_keys",
          [](DockCore& d, int p, const py::sequence& keys) {
            std::vector<std::string> ks = encode_keys(keys);
            py::gil_scoped_release release;
            d.erase_keys(p, ks);
          },
          py::arg("partition"), py::arg("keys"))
      .def(
          "erase_rows",
          [](DockCore& d, int p, const I64Array& rows) {
            py::gil_scoped_release release;
            d.erase_rows(p, rows.data(), static_cast<size_t>(rows.size()));
          },
          py::arg("partition"), py::arg("rows"))
      .def("clear", &DockCore::clear, py::arg("partition"), py::call_guard<py::gil_scoped_release>())
      .def("drop_partition", &DockCore::drop_partition, py::arg("partition"), py::call_guard<py::gil_scoped_release>())
      .def(
          "claim_in",
          [](DockCore& d, int p, int stage, int64_t max_rows, int64_t min_rows, double timeout, int64_t max_items,
             int64_t min_version) {
            std::vector<int64_t> rows;
            uint64_t epoch = 0, claim_id = 0;
            {
              py::gil_scoped_release release;
              rows = d.claim_in(p, stage, max_rows, min_rows, timeout, &epoch, max_items, &claim_id, min_version);
            }
            return py::make_tuple(to_array(std::move(rows)), epoch, claim_id);
          },
          py::arg("partition"), py::arg("stage"), py::arg("max_rows"), py::arg("min_rows"), py::arg("timeout"),
          py::arg("max_items") = 0, py::arg("min_version") = dock::Controller::kAnyVersion)
      .def(
          "claim_dp",
          [](DockCore& d, int p, int stage, const std::string& round, int dp_rank, int dp_size, int ranks,
             int64_t max_rows, int64_t min_rows, double timeout, int64_t min_version) {
            std::vector<int64_t> rows;
            uint64_t epoch = 0, claim_id = 0;
            {
              py::gil_scoped_release release;
              rows = d.claim_dp(p, stage, round, dp_rank, dp_size, ranks, max_rows, min_rows, timeout, &epoch,
                                &claim_id, min_version);
            }
            return py::make_tuple(to_array(std::move(rows)), epoch, claim_id);
          },
          py::arg("partition"), py::arg("stage"), py::arg("round"), py::arg("dp_rank"), py::arg("dp_size"),
          py::arg("ranks_per_replica"), py::arg("max_rows"), py::arg("min_rows"), py::arg("timeout"),
          py::arg("min_version") = dock::Controller::kAnyVersion)
      .def(
          "release_in",
          [](DockCore& d, int p, int stage, const I64Array& rows, int64_t epoch, uint64_t claim_id) {
            d.release_in(p, stage, rows.data(), static_cast<size_t>(rows.size()), epoch, claim_id);
          },
          py::arg("partition"), py::arg("stage"), py::arg("rows"), py::arg("epoch") = -1, py::arg("claim_id") = 0)
      .def(
          "complete_in",
          [](DockCore& d, int p, int stage, const I64Array& rows, int64_t epoch, uint64_t claim_id) {
            d.complete_in(p, stage, rows.data(), static_cast<size_t>(rows.size()), epoch, claim_id);
          },
          py::arg("partition"), py::arg("stage"), py::arg("rows"), py::arg("epoch") = -1, py::arg("claim_id") = 0)
      .def(
          "begin_put_in",
          [](DockCore& d, int p, const I64Array& rows, int64_t epoch, int stage, uint64_t claim_id) {
            uint64_t id = 0, put_epoch = 0;
            {
              py::gil_scoped_release release;
              id = d.begin_put_in(p, rows.data(), static_cast<size_t>(rows.size()), epoch, stage, claim_id, &put_epoch);
            }
            return py::make_tuple(id, put_epoch);
          },
          py::arg("partition"), py::arg("rows"), py::arg("epoch") = -1, py::arg("stage") = -1, py::arg("claim_id") = 0)
      .def(
          "put_in",
          [](DockCore& d, int p, const py::sequence& cols, const I64Array& rows, int64_t epoch, int stage,
             uint64_t claim_id) {
            std::vector<py::object> keep;
            std::vector<ColumnInput> inputs = parse_inputs(cols, static_cast<size_t>(rows.size()), keep);
            py::gil_scoped_release release;
            d.put_in(p, inputs, rows.data(), static_cast<size_t>(rows.size()), epoch, stage, claim_id);
          },
          py::arg("partition"), py::arg("columns"), py::arg("rows"), py::arg("epoch") = -1, py::arg("stage") = -1,
          py::arg("claim_id") = 0);
}

void bind_dock(py::module_& m) {
  py::class_<DockView>(m, "DockView", py::buffer_protocol(),
                       "Read-only bytes of a warehouse arena (zero-copy fetch); pins its iteration: the dock's "
                       "reset() refuses while one is alive.")
      .def(py::init([](py::object owner, uintptr_t address, size_t nbytes) {
             return std::make_unique<DockView>(std::move(owner), nullptr, reinterpret_cast<const uint8_t*>(address),
                                               nbytes);
           }),
           py::arg("owner"), py::arg("address"), py::arg("nbytes"),
           "A view of `nbytes` at `address` inside memory that `owner` keeps mapped (a shared arena); "
           "dropping the last reference drops `owner`.")
      .def_buffer([](DockView& v) {
        return py::buffer_info(const_cast<uint8_t*>(v.data()), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(v.nbytes())}, {static_cast<ssize_t>(1)}, /*readonly=*/true);
      })
      .def_property_readonly("address", [](const DockView& v) { return reinterpret_cast<uintptr_t>(v.data()); })
      .def_property_readonly("nbytes", &DockView::nbytes);

  py::class_<dock::DockCore> core(m, "DockCore",
                                  "The dock's control plane (and, for the local backend, its warehouses).");
  core.def(py::init([](const std::vector<ColumnTuple>& columns,
                       const std::vector<std::tuple<std::string, std::vector<std::string>, std::string>>& stages,
                       int64_t capacity, int64_t group_size, int warehouses, bool store_bytes) {
             dock::DockConfig cfg;
             cfg.columns = parse_columns(columns);
             for (const auto& [name, inputs, len_col] : stages) {
               cfg.stages.push_back(dock::StageSpec{name, inputs, len_col});
             }
             cfg.capacity = capacity;
             cfg.group_size = group_size;
             cfg.warehouses = warehouses;
             cfg.store_bytes = store_bytes;
             return std::make_unique<dock::DockCore>(std::move(cfg));
           }),
           py::arg("columns"), py::arg("stages"), py::arg("capacity"), py::arg("group_size"), py::arg("warehouses"),
           py::arg("store_bytes") = true,
           "store_bytes=False: metadata only (the Ray controller): the put protocol in steps (begin_put*, "
           "publish/abort_put) and reset in steps (begin_reset, reset_metadata, end_reset) carry what the "
           "warehouses elsewhere store.")
      .def_property_readonly("stores_bytes", &dock::DockCore::stores_bytes)
      .def("warehouse_rows", &dock::DockCore::warehouse_rows, py::arg("warehouse"),
           "(first row, rows) of a warehouse's contiguous range.")
      .def(
          "begin_put_new",
          [](dock::DockCore& d, int64_t n) {
            std::vector<int64_t> rows;
            uint64_t id = 0, epoch = 0;
            {
              py::gil_scoped_release release;  // may wait for a reset in flight
              id = d.begin_put_new(n, &rows, &epoch);
            }
            return py::make_tuple(to_array(std::move(rows)), id, epoch);
          },
          py::arg("n"), "(rows, put id, iteration): allocates n new rows for a put and registers it in flight.")
      .def(
          "begin_put",
          [](dock::DockCore& d, const I64Array& rows, int64_t epoch, int stage, uint64_t claim_id) {
            uint64_t id = 0, put_epoch = 0;
            {
              py::gil_scoped_release release;
              id = d.begin_put(rows.data(), static_cast<size_t>(rows.size()), epoch, stage, claim_id, &put_epoch);
            }
            return py::make_tuple(id, put_epoch);
          },
          py::arg("rows"), py::arg("epoch") = -1, py::arg("stage") = -1, py::arg("claim_id") = 0,
          "(put id, iteration): checks a put into allocated rows and registers it in flight.")
      .def(
          "publish",
          [](dock::DockCore& d, uint64_t put, const py::sequence& cols, const I64Array& rows, int stage,
             uint64_t claim_id, int partition) {
            std::vector<I64Array> keep;
            std::vector<dock::ColumnMark> marks = parse_marks(cols, static_cast<size_t>(rows.size()), keep);
            py::gil_scoped_release release;  // waits for the controllers' locks (and a reset in progress)
            d.publish(put, marks, rows.data(), static_cast<size_t>(rows.size()), stage, claim_id, partition);
          },
          py::arg("put"), py::arg("columns"), py::arg("rows"), py::arg("stage") = -1, py::arg("claim_id") = 0,
          py::arg("partition") = 0,
          "Publishes a put: columns are (column id, lengths or None); ends the put.")
      .def("abort_put", &dock::DockCore::abort_put, py::arg("put"), py::arg("give_rows_back") = true,
           py::call_guard<py::gil_scoped_release>(),
           "Ends a put; True when it was in flight (nothing of it published, and now nothing will be). "
           "give_rows_back: rows begin_put_new allocated for it go back (else they stay until the next reset).")
      .def_property_readonly("puts_in_flight", &dock::DockCore::puts_in_flight)
      .def("begin_reset", &dock::DockCore::begin_reset, py::arg("force") = false)
      .def(
          "reset_metadata",
          [](dock::DockCore& d, bool keep_unfinished) {
            std::vector<int64_t> kept;
            {
              py::gil_scoped_release release;
              kept = d.reset_metadata(keep_unfinished);
            }
            return to_array(std::move(kept));
          },
          py::arg("keep_unfinished") = false)
      .def("end_reset", &dock::DockCore::end_reset)
      .def("column_index", &dock::DockCore::column_index)
      .def("stage_index", &dock::DockCore::stage_index)
      .def_property_readonly("num_warehouses", &dock::DockCore::num_warehouses)
      .def(
          "put_new",
          [](dock::DockCore& d, const py::sequence& cols, int64_t n) {
            std::vector<py::object> keep;  // n <= 0 is refused by the allocator, naming the group size
            std::vector<ColumnInput> inputs = parse_inputs(cols, static_cast<size_t>(std::max<int64_t>(n, 0)), keep);
            std::vector<int64_t> rows;
            {
              py::gil_scoped_release release;
              rows = d.put_new(inputs, n);
            }
            return to_array(std::move(rows));
          },
          py::arg("columns"), py::arg("n"))
      .def(
          "put",
          [](dock::DockCore& d, const py::sequence& cols, const I64Array& rows, int64_t epoch, int stage,
             uint64_t claim_id) {
            std::vector<py::object> keep;
            std::vector<ColumnInput> inputs = parse_inputs(cols, static_cast<size_t>(rows.size()), keep);
            py::gil_scoped_release release;
            d.put(inputs, rows.data(), static_cast<size_t>(rows.size()), epoch, stage, claim_id);
          },
          py::arg("columns"), py::arg("rows"), py::arg("epoch") = -1, py::arg("stage") = -1, py::arg("claim_id") = 0)
      .def(
          "complete",
          [](dock::DockCore& d, int stage, const I64Array& rows, int64_t epoch, uint64_t claim_id) {
            d.complete(stage, rows.data(), static_cast<size_t>(rows.size()), epoch, claim_id);
          },
          py::arg("stage"), py::arg("rows"), py::arg("epoch") = -1, py::arg("claim_id") = 0)
      .def(
          "claim",
          [](dock::DockCore& d, int stage, int64_t max_rows, int64_t min_rows, double timeout, int64_t max_items) {
            std::vector<int64_t> rows;
            uint64_t epoch = 0, claim_id = 0;
            {
              py::gil_scoped_release release;
              rows = d.claim(stage, max_rows, min_rows, timeout, &epoch, max_items, &claim_id);
            }
            return py::make_tuple(to_array(std::move(rows)), epoch, claim_id);
          },
          py::arg("stage"), py::arg("max_rows"), py::arg("min_rows"), py::arg("timeout"), py::arg("max_items") = 0)
      .def(
          "release",
          [](dock::DockCore& d, int stage, const I64Array& rows, int64_t epoch, uint64_t claim_id) {
            d.release(stage, rows.data(), static_cast<size_t>(rows.size()), epoch, claim_id);
          },
          py::arg("stage"), py::arg("rows"), py::arg("epoch") = -1, py::arg("claim_id") = 0)
      .def_property_readonly("epoch", &dock::DockCore::epoch)
      .def("lengths",
           [](const dock::DockCore& d, int column, const I64Array& rows) {
             py::array_t<int64_t> out(rows.size());
             d.lengths(column, rows.data(), static_cast<size_t>(rows.size()), out.mutable_data());
             return out;
           })
      .def(
          "gather",
          [](dock::DockCore& d, int column, const I64Array& rows, py::buffer out, int64_t epoch) {
            size_t nbytes = 0;
            void* dst = writable_ptr(out, &nbytes);
            py::gil_scoped_release release;
            d.gather(column, rows.data(), static_cast<size_t>(rows.size()), dst, nbytes, epoch);
          },
          py::arg("column"), py::arg("rows"), py::arg("out"), py::arg("epoch") = -1)
      .def(
          "gather_padded",
          [](dock::DockCore& d, int column, const I64Array& rows, int64_t max_items, py::buffer out, int64_t epoch) {
            size_t nbytes = 0;
            void* dst = writable_ptr(out, &nbytes);
            const size_t need = static_cast<size_t>(rows.size()) * static_cast<size_t>(max_items) *
                                d.column(column).item_bytes();
            MSRL_CHECK(nbytes == need, kInvalidArgument, "padded output has ", nbytes, " bytes, needs ", need);
            py::gil_scoped_release release;
            d.gather_padded(column, rows.data(), static_cast<size_t>(rows.size()), max_items, dst, epoch);
          },
          py::arg("column"), py::arg("rows"), py::arg("max_items"), py::arg("out"), py::arg("epoch") = -1)
      .def(
          "view",
          [](py::object self, int column, const I64Array& rows, int64_t epoch) -> py::tuple {
            dock::DockCore& d = self.cast<dock::DockCore&>();
            const size_t n = static_cast<size_t>(rows.size());
            py::array_t<int64_t> lens(rows.size());
            const uint8_t* data = nullptr;
            size_t nbytes = 0;
            bool ok = false;
            {
              py::gil_scoped_release release;
              ok = d.view(column, rows.data(), n, &data, &nbytes, lens.mutable_data(), epoch);
            }
            if (!ok) return py::make_tuple(py::none(), lens);
            return py::make_tuple(py::cast(std::make_unique<DockView>(self, &d, data, nbytes)), lens);
          },
          py::arg("column"), py::arg("rows"), py::arg("epoch") = -1,
          "(DockView | None, lengths): a pinned view when the rows' bytes are contiguous in one arena.")
      .def_property_readonly("live_views", &dock::DockCore::live_views)
      .def("warehouse_of",
           [](const dock::DockCore& d, const I64Array& rows) {
             py::array_t<int32_t> out(rows.size());
             for (ssize_t i = 0; i < rows.size(); ++i) out.mutable_data()[i] = d.warehouse_of(rows.data()[i]);
             return out;
           })
      .def("allocated_rows", &dock::DockCore::allocated_rows)
      .def(
          "progress",
          [](const dock::DockCore& d, int stage, int partition) {
            return progress_dict(d.controller(stage, partition).progress());
          },
          py::arg("stage"), py::arg("partition") = 0)
      .def(
          "consumed",
          [](const dock::DockCore& d, int stage, int64_t row, int partition) {
            return d.controller(stage, partition).consumed(row);
          },
          py::arg("stage"), py::arg("row"), py::arg("partition") = 0)
      .def(
          "column_stats",
          [](const dock::DockCore& d, int column) {
            py::list out;
            for (int w = 0; w < d.num_warehouses(); ++w) {
              out.append(stats_dict(d.warehouse(w).column_stats(column)));
            }
            return out;
          },
          py::arg("column"), "Per warehouse: rows written, value bytes, arena bytes held and chunks of a column.")
      .def("warehouse_bytes",
           [](const dock::DockCore& d) {
             std::vector<int64_t> out;
             for (int w = 0; w < d.num_warehouses(); ++w) out.push_back(d.warehouse(w).bytes_held());
             return out;
           })
      .def("op_stats",
           [](const dock::DockCore& d) {
             py::dict out;
             out["put"] = op_stats(d.put_stats);
             out["claim"] = op_stats(d.claim_stats);
             if (d.stores_bytes()) out["fetch"] = op_stats(d.fetch_stats);  // else fetches bypass it
             return out;
           })
      .def(
          "reset",
          [](dock::DockCore& d, bool keep_unfinished) {
            std::vector<int64_t> kept;
            {
              py::gil_scoped_release release;
              kept = d.reset(keep_unfinished);
            }
            return to_array(std::move(kept));
          },
          py::arg("keep_unfinished") = false)
      .def("close", &dock::DockCore::close, py::call_guard<py::gil_scoped_release>());
  bind_dock_keys(core);

  py::class_<dock::Warehouse>(m, "Warehouse", "One warehouse: columnar arenas for a contiguous range of rows.")
      .def(py::init([](int id, int64_t row_begin, int64_t num_rows, const std::vector<ColumnTuple>& columns,
                       const std::vector<uintptr_t>& external) {
             std::vector<uint8_t*> ext;
             for (uintptr_t p : external) ext.push_back(reinterpret_cast<uint8_t*>(p));
             return std::make_unique<dock::Warehouse>(id, row_begin, num_rows, parse_columns(columns), ext);
           }),
           py::arg("id"), py::arg("row_begin"), py::arg("num_rows"), py::arg("columns"),
           py::arg("external_arenas") = std::vector<uintptr_t>{},
           "external_arenas: addresses of caller-owned memory (arena_capacity(c) bytes per column) that must "
           "outlive the warehouse, e.g. shared-memory mappings.")
      .def("arena_capacity", &dock::Warehouse::arena_capacity)
      .def(
          "add_column",
          [](dock::Warehouse& w, const ColumnTuple& col, uintptr_t external, bool declared) {
            ColumnSpec spec = parse_column(col);
            spec.declared = declared;
            return w.add_column(spec, reinterpret_cast<uint8_t*>(external));
          },
          py::arg("column"), py::arg("external") = 0, py::arg("declared") = true,
          "A column declared at run time (external: caller-owned arena memory, or 0); declared=False: a "
          "placeholder keeping ids aligned with the control plane.")
      .def(
          "set_column",
          [](dock::Warehouse& w, int c, const ColumnTuple& col, uintptr_t external) {
            w.set_column(c, parse_column(col), reinterpret_cast<uint8_t*>(external));
          },
          py::arg("id"), py::arg("column"), py::arg("external") = 0)
      .def("declared", &dock::Warehouse::declared, py::arg("column"))
      .def(
          "resize_external",
          [](dock::Warehouse& w, int column, uintptr_t base, int64_t capacity) {
            w.resize_external(column, reinterpret_cast<uint8_t*>(base), capacity);
          },
          py::arg("column"), py::arg("base"), py::arg("capacity"),
          "A ragged column's caller-provided arena, grown or shrunk: the same bytes at the same offsets, now "
          "at base with capacity bytes (the old memory must stay mapped for readers in flight).")
      .def(
          "column_stats", [](const dock::Warehouse& w, int column) { return stats_dict(w.column_stats(column)); },
          py::arg("column"))
      .def_property_readonly("num_columns", &dock::Warehouse::num_columns)
      .def("locate",
           [](const dock::Warehouse& w, int column, const I64Array& rows) {
             py::array_t<int64_t> offs(rows.size()), lens(rows.size());
             w.locate(column, rows.data(), static_cast<size_t>(rows.size()), offs.mutable_data(), lens.mutable_data());
             return py::make_tuple(offs, lens);
           })
      .def(
          "reserve",
          [](dock::Warehouse& w, const py::sequence& cols, const I64Array& rows, bool overwrite) {
            // [(column, lengths | None)] -> reservations, all or none.
            std::vector<int> ids;
            std::vector<const int64_t*> lens;
            std::vector<I64Array> keep;
            for (const py::handle& h : cols) {
              py::sequence t = h.cast<py::sequence>();  // type-checked (a tuple or list)
              ids.push_back(t[0].cast<int>());
              if (t[1].is_none()) {
                lens.push_back(nullptr);
              } else {
                keep.push_back(t[1].cast<I64Array>());
                MSRL_CHECK(keep.back().size() == rows.size(), kInvalidArgument, "reserve: ", keep.back().size(),
                           " lengths for ", rows.size(), " rows");
                lens.push_back(keep.back().data());
              }
            }
            std::vector<std::shared_ptr<dock::Reservation>> res;
            {
              py::gil_scoped_release release;
              for (dock::Reservation& r :
                   w.reserve_columns(ids, rows.data(), static_cast<size_t>(rows.size()), lens, overwrite)) {
                res.push_back(std::make_shared<dock::Reservation>(std::move(r)));
              }
            }
            return res;
          },
          py::arg("columns"), py::arg("rows"), py::arg("overwrite") = false)
      .def("commit",
           [](dock::Warehouse& w, const std::vector<std::shared_ptr<dock::Reservation>>& res) {
             for (auto& r : res) w.commit(*r);
           })
      .def("abort",
           [](dock::Warehouse& w, const std::vector<std::shared_ptr<dock::Reservation>>& res) {
             for (auto& r : res) w.abort(*r);
           })
      .def_property_readonly("id", &dock::Warehouse::id)
      .def_property_readonly("row_begin", &dock::Warehouse::row_begin)
      .def_property_readonly("num_rows", &dock::Warehouse::num_rows)
      .def(
          "put",
          [](dock::Warehouse& w, const py::sequence& cols, const I64Array& rows, bool overwrite) {
            // All or nothing over the columns, as a DockCore put.
            std::vector<py::object> keep;
            std::vector<ColumnInput> inputs = parse_inputs(cols, static_cast<size_t>(rows.size()), keep);
            py::gil_scoped_release release;
            dock::store_columns(
                {&w}, [](int64_t) { return 0; }, inputs, rows.data(), static_cast<size_t>(rows.size()), overwrite);
          },
          py::arg("columns"), py::arg("rows"), py::arg("overwrite") = false)
      .def("lengths",
           [](const dock::Warehouse& w, int column, const I64Array& rows) {
             py::array_t<int64_t> out(rows.size());
             w.lengths(column, rows.data(), static_cast<size_t>(rows.size()), out.mutable_data());
             return out;
           })
      .def("gather",
           [](const dock::Warehouse& w, int column, const I64Array& rows, py::buffer out) {
             size_t nbytes = 0;
             void* dst = writable_ptr(out, &nbytes);
             py::gil_scoped_release release;
             w.gather(column, rows.data(), static_cast<size_t>(rows.size()), dst, nbytes);
           })
      .def("erase",
           [](dock::Warehouse& w, const std::vector<int>& columns, const I64Array& rows) {
             for (int c : columns) w.erase(c, rows.data(), static_cast<size_t>(rows.size()));
           })
      .def("gather_padded",
           [](const dock::Warehouse& w, int column, const I64Array& rows, int64_t max_items, py::buffer out) {
             size_t nbytes = 0;
             void* dst = writable_ptr(out, &nbytes);
             const size_t need =
                 static_cast<size_t>(rows.size()) * static_cast<size_t>(max_items) *
                 w.columns()[static_cast<size_t>(std::clamp(column, 0, w.num_columns() - 1))].item_bytes();
             MSRL_CHECK(nbytes == need, kInvalidArgument, "padded output has ", nbytes, " bytes, needs ", need);
             py::gil_scoped_release release;
             w.gather_padded(column, rows.data(), static_cast<size_t>(rows.size()), max_items, dst);
           })
      .def("bytes_held", &dock::Warehouse::bytes_held)
      .def(
          "reset",
          [](dock::Warehouse& w, py::object keep_rows) {
            if (keep_rows.is_none()) {
              py::gil_scoped_release release;
              w.reset();
              return;
            }
            std::vector<int64_t> keep = keep_rows.cast<std::vector<int64_t>>();
            py::gil_scoped_release release;
            w.reset(keep);
          },
          py::arg("keep_rows") = py::none(), "Forgets every row but keep_rows (their bytes are compacted).");

  py::class_<dock::Reservation, std::shared_ptr<dock::Reservation>>(
      m, "Reservation", "Rows of one column reserved in a warehouse arena, not yet readable.")
      .def_property_readonly("column", [](const dock::Reservation& r) { return r.column; })
      .def_property_readonly("dst_offsets",
                             [](const dock::Reservation& r) { return to_array(std::vector<int64_t>(r.dst_offsets)); })
      .def_property_readonly("nbytes",
                             [](const dock::Reservation& r) { return to_array(std::vector<int64_t>(r.nbytes)); });

  m.def(
      "dock_dtypes",
      [] {
        std::vector<std::pair<std::string, size_t>> out;
        for (const auto& t : dock::dtype_table()) out.emplace_back(t.name, t.size);
        return out;
      },
      "The dock's dtype table: (name, bytes per element), in the native order (one table, both backends).");
  m.def(
      "dock_copy_rows",
      [](py::buffer dst, const I64Array& dst_offsets, py::buffer src, const I64Array& src_offsets,
         const I64Array& nbytes) {
        size_t dst_size = 0;
        uint8_t* d = static_cast<uint8_t*>(writable_ptr(dst, &dst_size));
        Bytes s = bytes_of(src, "dock_copy_rows");
        const ssize_t n = nbytes.size();
        MSRL_CHECK(dst_offsets.size() == n && src_offsets.size() == n, kInvalidArgument,
                   "dock_copy_rows: offsets and sizes must have the same length");
        std::vector<dock::Segment> segs;
        segs.reserve(static_cast<size_t>(n));
        for (ssize_t i = 0; i < n; ++i) {
          const int64_t dof = dst_offsets.data()[i], sof = src_offsets.data()[i], nb = nbytes.data()[i];
          MSRL_CHECK(dof >= 0 && sof >= 0 && nb >= 0 && static_cast<size_t>(dof + nb) <= dst_size &&
                         static_cast<size_t>(sof + nb) <= s.nbytes,
                     kInvalidArgument, "dock_copy_rows: segment ", i, " (dst ", dof, ", src ", sof, ", ", nb,
                     " bytes) is outside the buffers (", dst_size, " and ", s.nbytes, " bytes)");
          if (nb) segs.push_back({d + dof, static_cast<const uint8_t*>(s.ptr) + sof, static_cast<size_t>(nb)});
        }
        py::gil_scoped_release release;
        dock::copy_segments(std::move(segs));
      },
      "Copies byte segments between two buffers (bounds-checked, GIL released, large copies threaded).");
}

}  // namespace msrl::bindings
