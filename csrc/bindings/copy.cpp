// Copy plans, the async copy engine and its tickets.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/bindings.h"
#include "bindings/objects.h"
#include "common/error.h"
#include "copy/copy_engine.h"

namespace msrl::bindings {

namespace {

struct PyTicket {
  std::shared_ptr<Ticket> ticket;
  std::shared_ptr<CopyEngine> engine;  // keeps the engine (and its threads) alive while waited on
};

CopyKind parse_kind(const std::string& kind) {
  if (kind == "h2h") return CopyKind::kHostToHost;
  if (kind == "h2d") return CopyKind::kHostToDevice;
  if (kind == "d2h") return CopyKind::kDeviceToHost;
  if (kind == "d2d") return CopyKind::kDeviceToDevice;
  MSRL_THROW(kInvalidArgument, "unknown copy kind '", kind, "'; allowed: h2h, h2d, d2h, d2d");
}

// A Stream object, or an integer handle (torch.cuda.current_stream().cuda_stream; 0 is the default stream).
// None: the default stream.
Stream parse_stream(const py::object& obj) {
  if (obj.is_none()) return nullptr;
  if (py::isinstance<PyStream>(obj)) return obj.cast<PyStream&>().stream;
  if (py::isinstance<py::int_>(obj)) {
    auto value = obj.cast<py::int_>();
    MSRL_CHECK(value.cast<long long>() >= 0, kInvalidArgument, "stream handle must be >= 0, got ",
               py::str(obj).cast<std::string>());
    return reinterpret_cast<Stream>(static_cast<uintptr_t>(value.cast<unsigned long long>()));
  }
  MSRL_THROW(kInvalidArgument, "stream must be None, a msrl_core Stream or an int handle, got ",
             py::str(py::type::of(obj)).cast<std::string>());
}

// `after=`: None orders nothing; any stream given, the default stream (handle 0) included, orders the copy
// after the work already enqueued there. (0 used to read as "none": on CUDA that dropped every ordering
// after torch's default stream, which the engine's non-blocking streams do not synchronise with.)
CopyEngine::After parse_after(const py::object& obj) {
  if (obj.is_none()) return std::nullopt;
  return parse_stream(obj);
}

PyTicket& check_ticket(const py::object& obj) {
  MSRL_CHECK(py::isinstance<PyTicket>(obj), kInvalidArgument, "expected a Ticket, got ",
             py::str(py::type::of(obj)).cast<std::string>());
  return obj.cast<PyTicket&>();
}

py::dict engine_stats(const EngineStats& s) {
  py::dict d;
  d["ordered"] = s.ordered;
  d["submitted"] = s.submitted;
  d["completed"] = s.completed;
  d["failed"] = s.failed;
  d["bytes_h2d"] = s.bytes_h2d;
  d["bytes_d2h"] = s.bytes_d2h;
  d["bytes_other"] = s.bytes_other;
  d["bounced_bytes"] = s.bounced_bytes;
  return d;
}

}  // namespace

void bind_copy(py::module_& m) {
  py::class_<CopyPlan, std::shared_ptr<CopyPlan>>(m, "CopyPlan")
      .def(py::init([](py::array_t<int64_t, py::array::c_style | py::array::forcecast> descs) {
             MSRL_CHECK(descs.ndim() == 2 && descs.shape(1) == 6, kInvalidArgument,
                        "descriptors must have shape (N, 6) [src_offset, dst_offset, rows, row_bytes, src_pitch, "
                        "dst_pitch], got ndim=",
                        descs.ndim(), (descs.ndim() >= 2 ? " with " : ""),
                        (descs.ndim() >= 2 ? std::to_string(descs.shape(1)) + " columns" : std::string()));
             size_t n = static_cast<size_t>(descs.shape(0));
             const int64_t* raw = descs.data();
             for (size_t i = 0; i < n * 6; ++i) {
               static const char* names[] = {"src_offset", "dst_offset", "rows", "row_bytes", "src_pitch", "dst_pitch"};
               MSRL_CHECK(raw[i] >= 0, kInvalidArgument, "descriptor ", i / 6, ": ", names[i % 6],
                          " must be >= 0, got ", raw[i]);
             }
             std::vector<CopyDescriptor> v(n);
             std::memcpy(static_cast<void*>(v.data()), raw, n * sizeof(CopyDescriptor));
             py::gil_scoped_release release;
             return std::make_shared<CopyPlan>(std::move(v));
           }),
           py::arg("descriptors"))
      .def_property_readonly("descriptors",
                             [](const CopyPlan& p) {
                               const auto& d = p.descriptors();
                               py::array_t<uint64_t> out({static_cast<py::ssize_t>(d.size()), py::ssize_t{6}});
                               if (!d.empty())
                                 std::memcpy(out.mutable_data(), d.data(), d.size() * sizeof(CopyDescriptor));
                               return out;
                             })
      .def_property_readonly("input_count", &CopyPlan::input_count)
      .def_property_readonly("bytes", &CopyPlan::bytes)
      .def_property_readonly("src_extent", &CopyPlan::src_extent)
      .def_property_readonly("dst_extent", &CopyPlan::dst_extent)
      .def("__len__", [](const CopyPlan& p) { return p.descriptors().size(); });

  py::class_<PyTicket>(m, "Ticket")
      .def_property_readonly("id", [](const PyTicket& t) { return t.ticket->id(); })
      .def_property_readonly("nbytes", [](const PyTicket& t) { return t.ticket->bytes(); })
      .def_property_readonly("seconds", [](const PyTicket& t) { return t.ticket->seconds(); })
      .def("done", [](const PyTicket& t) { return t.ticket->done(); })
      .def(
          "wait",
          [](const PyTicket& t, double timeout) {
            double s = checked_timeout(timeout);
            py::gil_scoped_release release;
            t.engine->wait(*t.ticket, s);
          },
          py::arg("timeout") = 60.0);

  py::class_<CopyEngine, std::shared_ptr<CopyEngine>>(m, "CopyEngine")
      .def(py::init([](const std::shared_ptr<PyRuntime>& runtime, int64_t chunk_bytes, bool force_bounce, int device) {
             MSRL_CHECK(runtime != nullptr, kInvalidArgument, "runtime is None");
             EngineOptions o;
             o.chunk_bytes = checked_size(chunk_bytes, "chunk_bytes");
             o.force_bounce = force_bounce;
             o.device = device;
             return std::make_shared<CopyEngine>(runtime->rt, o);
           }),
           py::arg("runtime"), py::arg("chunk_bytes") = 8 << 20, py::arg("force_bounce") = false, py::arg("device") = 0)
      .def(
          "copy",
          [](const std::shared_ptr<CopyEngine>& e, const py::int_& dst, const py::int_& src, int64_t nbytes,
             const std::string& kind, const py::object& after) {
            uint64_t n = checked_size(nbytes, "nbytes");
            void* d = checked_pointer(dst, "dst", n == 0);
            void* s = checked_pointer(src, "src", n == 0);
            CopyKind k = parse_kind(kind);
            CopyEngine::After a = parse_after(after);
            py::gil_scoped_release release;
            return PyTicket{e->copy(d, s, n, k, a), e};
          },
          py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("kind"), py::arg("after") = py::none())
      .def(
          "copy_batch",
          [](const std::shared_ptr<CopyEngine>& e, const std::vector<py::int_>& dsts, const std::vector<py::int_>& srcs,
             const std::vector<int64_t>& nbytes, const std::string& kind, const py::object& after) {
            MSRL_CHECK(dsts.size() == srcs.size() && srcs.size() == nbytes.size(), kInvalidArgument,
                       "dsts, srcs and nbytes must have the same length, got ", dsts.size(), ", ", srcs.size(), " and ",
                       nbytes.size());
            std::vector<CopyRegion> regions(dsts.size());
            for (size_t i = 0; i < regions.size(); ++i) {
              regions[i].nbytes = checked_size(nbytes[i], "nbytes");
              regions[i].dst = checked_pointer(dsts[i], "dst", regions[i].nbytes == 0);
              regions[i].src = checked_pointer(srcs[i], "src", regions[i].nbytes == 0);
            }
            CopyKind k = parse_kind(kind);
            CopyEngine::After a = parse_after(after);
            py::gil_scoped_release release;
            return PyTicket{e->copy_batch(std::move(regions), k, a), e};
          },
          py::arg("dsts"), py::arg("srcs"), py::arg("nbytes"), py::arg("kind"), py::arg("after") = py::none())
      .def(
          "execute",
          [](const std::shared_ptr<CopyEngine>& e, const std::shared_ptr<CopyPlan>& plan, const py::int_& dst,
             int64_t dst_bytes, const py::int_& src, int64_t src_bytes, const std::string& kind,
             const py::object& after) {
            MSRL_CHECK(plan != nullptr, kInvalidArgument, "plan is None");
            void* d = checked_pointer(dst, "dst");
            void* s = checked_pointer(src, "src");
            uint64_t dn = checked_size(dst_bytes, "dst_bytes"), sn = checked_size(src_bytes, "src_bytes");
            CopyKind k = parse_kind(kind);
            CopyEngine::After a = parse_after(after);
            py::gil_scoped_release release;
            return PyTicket{e->execute(plan, d, dn, s, sn, k, a), e};
          },
          py::arg("plan"), py::arg("dst"), py::arg("dst_bytes"), py::arg("src"), py::arg("src_bytes"), py::arg("kind"),
          py::arg("after") = py::none())
      .def(
          "wait",
          [](const CopyEngine& e, const py::object& ticket, double timeout) {
            auto& t = check_ticket(ticket);
            double s = checked_timeout(timeout);
            py::gil_scoped_release release;
            e.wait(*t.ticket, s);
          },
          py::arg("ticket"), py::arg("timeout") = 60.0)
      .def(
          "order_stream",
          [](const CopyEngine& e, const py::object& ticket, const py::object& stream, double timeout) {
            auto& t = check_ticket(ticket);
            Stream st = parse_stream(stream);
            double s = checked_timeout(timeout);
            py::gil_scoped_release release;
            e.order_stream(*t.ticket, st, s);
          },
          py::arg("ticket"), py::arg("stream"), py::arg("timeout") = 60.0)
      .def(
          "synchronize",
          [](CopyEngine& e, double timeout) {
            double s = checked_timeout(timeout);
            py::gil_scoped_release release;
            e.synchronize(s);
          },
          py::arg("timeout") = 60.0)
      .def("stream_handle",
           [](const CopyEngine& e, const std::string& kind) {
             return reinterpret_cast<uintptr_t>(e.stream(parse_kind(kind)));
           })
      .def_property_readonly("device", &CopyEngine::device)
      .def("stats", [](const CopyEngine& e) { return engine_stats(e.stats()); });
}

}  // namespace msrl::bindings
