// The only binding file: a thin pybind11 face over csrc/engine (and, in the
// submodule bench, csrc/bench's timed loops). Buffers go in
// through the buffer protocol (numpy, memoryview, DLPack-backed arrays) and come
// out as numpy arrays over engine memory that keep that memory alive. Every
// call that can wait releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include "bench/bench_loops.h"
#include "engine/channel.h"
#include "engine/copy.h"
#include "engine/doubling.h"
#include "engine/engine.h"
#include "engine/hierarchical.h"
#include "engine/op_channels.h"
#include "engine/ring.h"
#include "engine/socket_util.h"

namespace py = pybind11;
using namespace rdkeras;

namespace {

struct Span {
  void* ptr;
  size_t size;
};

Span span(const py::buffer& buffer, bool writable) {
  py::buffer_info info = buffer.request(writable);
  const bool contiguous = [&] {
    py::ssize_t expect = info.itemsize;
    for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] != 1 && info.strides[d] != expect) return false;
      expect *= info.shape[d];
    }
    return true;
  }();
  if (!contiguous) throw py::value_error("buffer must be C-contiguous (use numpy.ascontiguousarray)");
  return {info.ptr, static_cast<size_t>(info.size * info.itemsize)};
}

// A reference to a Python object, dropped with the GIL held (the engine may let go of it from any thread).
std::shared_ptr<void> keepAlive(const py::handle& obj) {
  return std::shared_ptr<void>(new py::object(py::reinterpret_borrow<py::object>(obj)), [](void* p) {
    if (!Py_IsInitialized()) return;  // interpreter gone: nothing left to release
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
}

py::dict countersDict(const TrackerCounters& c) {
  py::dict d;
  d["registrations"] = c.registrations;
  d["deregistrations"] = c.deregistrations;
  d["bytes_registered"] = c.bytes_registered;
  d["cache_hits"] = c.cache_hits;
  d["pool_allocations"] = c.pool_allocations;
  d["pool_reuses"] = c.pool_reuses;
  d["pool_bytes_reserved"] = c.pool_bytes_reserved;
  d["pool_bytes_in_use"] = c.pool_bytes_in_use;
  d["pool_bytes_discarded"] = c.pool_bytes_discarded;
  return d;
}

// Where the transport registers (pins) local buffers, registers a buffer from
// outside the arena together with a reference to its Python owner, so the
// cached registration can never outlive the memory (see TensorTracker).
void pin(Engine& e, const py::handle& obj, const Span& s) {
  if (s.size == 0 || !e.connected() || !e.transport().needsLocalRegistration() ||
      e.arena().contains(s.ptr, s.size))
    return;
  e.tracker().registerLocal(s.ptr, s.size, keepAlive(obj));
}

// A buffer's span, pinned where the transport needs it (see pin).
Span pinnedSpan(Engine& e, const py::buffer& b, bool writable) {
  Span s = span(b, writable);
  pin(e, b, s);
  return s;
}

// rdkeras._engine.PeerError, kept for the process's life (translations happen until exit).
py::object* peer_error = nullptr;

// Runs an operation involving `peer`; a PeerError leaves as the root cause (the rank that
// failed first, told to every other rank: Engine::rootCause).
template <typename F>
auto guarded(Engine& e, int peer, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const PeerError& err) {
    throw e.rootCause(err, peer);
  } catch (const EngineError&) {
    e.checkPeerFailure();  // e.g. a stale key on a peer tearing down after a failure: name the failure
    throw;
  }
}

// guarded(...) without the GIL (the operation may wait); the GIL is back before the result is used.
template <typename F>
auto guardedNoGil(Engine& e, int peer, F&& f) -> decltype(f()) {
  py::gil_scoped_release nogil;
  return guarded(e, peer, std::forward<F>(f));
}

// A 1-D uint8 array over `nbytes` at `ptr` whose base keeps `owner` alive.
py::array byteArray(const void* ptr, size_t nbytes, py::handle owner) {
  return py::array(py::dtype("uint8"), {static_cast<py::ssize_t>(nbytes)}, {1}, ptr, owner);
}

// A uint8 array over a tracker block; the block returns to the pool when the array dies.
py::array blockArray(const std::shared_ptr<Engine>& engine, void* ptr, size_t nbytes) {
  struct Holder {
    std::shared_ptr<Engine> engine;
    void* ptr;
  };
  auto* holder = new Holder{engine, ptr};
  py::capsule owner(holder, [](void* h) {
    auto* b = static_cast<Holder*>(h);
    b->engine->tracker().release(b->ptr);
    delete b;
  });
  return byteArray(ptr, nbytes, owner);
}

py::dict trafficDict(Engine& e) {
  const TransportStats& s = e.transportStats();
  py::dict d;
  d["bytes_written"] = s.bytes_written.load();
  d["bytes_read"] = s.bytes_read.load();
  d["writes"] = s.writes.load();
  d["reads"] = s.reads.load();
  d["flags"] = s.flags.load();
  for (const auto& [part, stats] : e.transportParts()) {  // shm+tcp: each link kind's share
    d[py::str("bytes_written/" + part)] = stats->bytes_written.load();
    d[py::str("bytes_read/" + part)] = stats->bytes_read.load();
  }
  d["bytes_received"] = e.bytesReceived();
  d["wait_seconds"] = e.waitSeconds();
  return d;
}

// An allreduce's inputs: float32 or float64 arrays of one dtype, C-contiguous, pinned where the transport
// needs it; sets *dtype.
std::vector<ConstSpan> reduceInputs(Engine& engine, const std::vector<py::array>& arrays, DType* dtype) {
  std::vector<ConstSpan> spans;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const py::array& a = arrays[i];
    const char kind = a.dtype().kind();
    const auto size = a.dtype().itemsize();
    if (kind != 'f' || (size != 4 && size != 8))
      throw py::type_error("allreduce supports float32 and float64 tensors");
    const DType d = size == 4 ? DType::kFloat32 : DType::kFloat64;
    if (i == 0) *dtype = d;
    if (d != *dtype) throw py::type_error("allreduce: all tensors must share one dtype");
    if (!(a.flags() & py::array::c_style)) throw py::value_error("allreduce: tensors must be C-contiguous");
    spans.push_back({a.data(), static_cast<size_t>(a.nbytes())});
    pin(engine, a, {const_cast<void*>(a.data()), static_cast<size_t>(a.nbytes())});
  }
  return spans;
}

// Views into the group's output block, 64-byte aligned, each shaped as its input: TensorFlow aliases them.
py::list reduceOutputs(const py::object& group, const std::vector<py::array>& arrays,
                       const AllreduceResult& r) {
  py::list result;
  for (size_t i = 0; i < arrays.size(); ++i) {
    std::vector<py::ssize_t> shape(arrays[i].shape(), arrays[i].shape() + arrays[i].ndim());
    result.append(py::array(arrays[i].dtype(), shape, r.out + r.offsets[i], group));
  }
  return result;
}

// The wire type a caller names ("float16", "bfloat16"; None: the tensors' own), for float32 tensors.
std::optional<DType> wireType(const std::optional<std::string>& wire, DType dtype) {
  if (!wire) return std::nullopt;
  DType w;
  if (*wire == "float16")
    w = DType::kFloat16;
  else if (*wire == "bfloat16")
    w = DType::kBFloat16;
  else
    throw py::value_error("allreduce: wire must be 'float16', 'bfloat16' or None, got '" + *wire + "'");
  if (dtype != DType::kFloat32)
    throw py::type_error(std::string("allreduce: only float32 tensors travel as ") + *wire + ", not " +
                         dtypeName(dtype));
  return w;
}

// Fresh float32 arrays shaped as `arrays`, for sums cast back from a wire type; *outputs: their data.
py::list freshFloat32(const std::vector<py::array>& arrays, std::vector<float*>* outputs) {
  py::list result;
  for (const auto& a : arrays) {
    py::array_t<float> out(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
    outputs->push_back(out.mutable_data());
    result.append(out);
  }
  return result;
}

// An allreduce of float32 `arrays` (their `spans`) that travels as `wire`: `reduce` sums the wire-typed
// copies, and fresh float32 arrays hold the sums cast back, scaled by `scale`.
py::list allreduceCastBack(Engine& e, const std::vector<py::array>& arrays,
                           const std::vector<ConstSpan>& spans, DType wire, float scale, WireScratch& scratch,
                           const std::function<AllreduceResult(const std::vector<ConstSpan>&)>& reduce) {
  std::vector<float*> outputs;
  py::list result = freshFloat32(arrays, &outputs);
  guardedNoGil(e, -1, [&] { allreduceOnWire(spans, outputs, wire, scale, scratch, reduce); });
  return result;
}

// A RingAllreduce's or DoublingAllreduce's allreduce: views of its output block, or with a `wire` type fresh
// float32 arrays cast back from the wire's sums.
template <typename Group>
py::list groupAllreduce(const py::object& self, const std::vector<py::array>& arrays, bool average,
                        const std::optional<std::string>& wire) {
  auto& group = self.cast<Group&>();
  DType dtype = DType::kFloat32;
  std::vector<ConstSpan> spans = reduceInputs(*group.engine(), arrays, &dtype);
  const std::optional<DType> narrow = wireType(wire, dtype);
  if (narrow) {
    const float scale = average ? 1.0f / static_cast<float>(group.size()) : 1.0f;
    return allreduceCastBack(*group.engine(), arrays, spans, *narrow, scale, group.wireScratch(),
                             [&](const std::vector<ConstSpan>& in) { return group.run(in, *narrow, false); });
  }
  const AllreduceResult r =
      guardedNoGil(*group.engine(), -1, [&] { return group.run(spans, dtype, average); });
  return reduceOutputs(self, arrays, r);
}

// RingAllreduce.allreduce_hierarchical: this ring inside the host, `across` between hosts (hierarchical.h).
py::list ringAllreduceHierarchical(const py::object& self, const std::vector<py::array>& arrays, bool average,
                                   RingAllreduce& across, int world, const std::optional<std::string>& wire,
                                   bool within) {
  auto& ring = self.cast<RingAllreduce&>();
  DType dtype = DType::kFloat32;
  std::vector<ConstSpan> spans = reduceInputs(*ring.engine(), arrays, &dtype);
  const std::optional<DType> narrow = wireType(wire, dtype);
  if (narrow && within) {  // the wire type inside each host too: fresh float32 arrays cast back
    const float scale = average ? 1.0f / static_cast<float>(world) : 1.0f;
    return allreduceCastBack(*ring.engine(), arrays, spans, *narrow, scale, ring.wireScratch(),
                             [&](const std::vector<ConstSpan>& in) {
                               return hierarchicalAllreduce(ring, across, in, *narrow, false, world, *narrow);
                             });
  }
  const AllreduceResult r = guardedNoGil(*ring.engine(), -1, [&] {
    return hierarchicalAllreduce(ring, across, spans, dtype, average, world, narrow.value_or(dtype));
  });
  return reduceOutputs(self, arrays, r);
}

void bindErrors(py::module_& m) {
  auto engine_error = py::register_exception<EngineError>(m, "EngineError", PyExc_RuntimeError);
  py::register_exception<TimeoutError>(m, "TimeoutError",
                                       py::make_tuple(engine_error, py::handle(PyExc_TimeoutError)));
  // PeerError carries .rank (the rank that failed, where known); a translator sets it.
  // The class object is kept for the process's life (it must outlive every translation).
  peer_error = new py::object(py::reinterpret_steal<py::object>(
      PyErr_NewException("rdkeras._engine.PeerError",
                         py::make_tuple(engine_error, py::handle(PyExc_ConnectionError)).ptr(), nullptr)));
  peer_error->attr("rank") = py::none();
  peer_error->attr("__doc__") = "A peer died or closed its connection; .rank names it where known.";
  m.attr("PeerError") = *peer_error;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PeerError& e) {
      py::object err = (*peer_error)(e.what());
      if (e.rank() >= 0) err.attr("rank") = e.rank();
      PyErr_SetObject(peer_error->ptr(), err.ptr());
    }
  });
  py::register_exception<RemoteAccessError>(m, "RemoteAccessError", engine_error);
  py::register_exception<AuthenticationError>(m, "AuthenticationError", engine_error);
}

// What the face asks before it has an engine: transports, this host, the op table, the tracker's sizes.
void bindQueries(py::module_& m) {
  m.def("native_transports", &nativeTransports);
  m.def(
      "op_api", [] { return reinterpret_cast<uintptr_t>(opApi()); },
      "The address of the C table rdkeras's TensorFlow ops call the channels through (csrc/tfops/op_api.h).");
  m.def("host_identity", &hostIdentity,
        "Equal for processes that can reach each other's shm (see socket_util.h).");
  m.def("verbs_why_not_viable", &verbsWhyNotViable,
        "Empty when transport='verbs' can run here, else why not.");
  m.def("size_class", &TensorTracker::sizeClass, "Bytes the tracker's pool reserves for an n-byte tensor.");
}

using EngineClass = py::class_<Engine, std::shared_ptr<Engine>>;

// Engine(...): the face's keyword arguments as EngineOptions.
std::shared_ptr<Engine> newEngine(int rank, int world_size, const std::string& transport, size_t arena_bytes,
                                  double timeout, const std::string& advertise_host,
                                  const std::string& bind_host, const std::string& ib_device, int ib_port,
                                  int ib_gid_index, int64_t nt_threshold, double heartbeat_timeout,
                                  double progress_timeout) {
  EngineOptions o;
  o.transport = transport;
  o.arena_bytes = arena_bytes;
  o.timeout_s = timeout;
  o.heartbeat_s = heartbeat_timeout;
  o.progress_s = progress_timeout;
  TransportOptions& t = o.transport_options;
  t.advertise_host = advertise_host;
  t.bind_host = bind_host;
  t.ib_device = ib_device;
  t.ib_port = ib_port;
  t.ib_gid_index = ib_gid_index;
  t.nt_threshold = nt_threshold > 0 ? static_cast<size_t>(nt_threshold) : SIZE_MAX;  // 0: never
  return std::make_shared<Engine>(rank, world_size, o);
}

// Construction, connection and closing.
void bindEngineLifecycle(EngineClass& c) {
  c.def(py::init(&newEngine), py::arg("rank"), py::arg("world_size"), py::arg("transport"),
        py::arg("arena_bytes"), py::arg("timeout"), py::arg("advertise_host") = "127.0.0.1",
        py::arg("bind_host") = "127.0.0.1", py::arg("ib_device") = "", py::arg("ib_port") = 0,
        py::arg("ib_gid_index") = 0, py::arg("nt_threshold") = int64_t{8} << 20,
        py::arg("heartbeat_timeout") = 30.0, py::arg("progress_timeout") = -1.0)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("world_size", &Engine::worldSize)
      .def_property_readonly("transport", &Engine::transportName)
      .def_property_readonly("timeout", &Engine::timeout)
      .def_property_readonly("heartbeat_timeout", &Engine::heartbeatTimeout)
      .def_property_readonly("progress_timeout", &Engine::progressTimeout)
      .def("wait_named_hung", &Engine::waitNamedHung, py::call_guard<py::gil_scoped_release>(),
           "Blocks until a peer names this rank hung (returns what it said) or the engine closes (returns "
           "'').")
      .def_property_readonly(
          "progress",
          [](const Engine& e) {
            const ProgressRecord r = e.progress();
            return py::make_tuple(r.entered, r.finished, r.labelText());
          },
          "(collectives entered, collectives finished, the last one's label): what peers read of this rank.")
      .def_property_readonly(
          "flight_record",
          [](const Engine& e) {
            py::list out;
            for (const FlightEntry& f : e.flightRecord())
              out.append(py::make_tuple(f.number, std::string(f.label, strnlen(f.label, sizeof(f.label))),
                                        f.bytes, f.members, f.start_ns, f.end_ns, f.failed));
            return out;
          },
          "This rank's last collectives, oldest first: (number, label, bytes, members, start_ns, end_ns (0: "
          "under "
          "way), failed).")
      .def("begin_close", &Engine::beginClose,
           "No operation may start or go on from now; another thread's wait ends with an error.")
      .def_property_readonly("descriptor", &Engine::localDescriptor)
      .def(
          "connect",
          [](Engine& e, const std::vector<std::string>& descriptors, const py::bytes& key, py::object watch,
             double timeout) {
            const std::string k = key;
            std::function<void()> w;
            if (!watch.is_none())
              w = [fn = watch.ptr()] {  // a borrowed callable (alive for this call): copies touch no refcount
                py::gil_scoped_acquire gil;
                py::handle{fn}();
              };
            py::gil_scoped_release nogil;
            e.connect(descriptors, k, std::move(w), timeout);
          },
          py::arg("descriptors"), py::arg("key"), py::arg("watch") = py::none(), py::arg("timeout") = 0.0,
          "Connects to every peer within `timeout` s (0: the engine's timeout); `watch()` runs about every "
          "100 ms meanwhile and may raise to give up.")
      .def("report_failure", &Engine::reportFailure, py::arg("rank"), py::arg("why"),
           py::call_guard<py::gil_scoped_release>(),
           "The face learned that `rank` failed (e.g. from the store): tell every other rank.")
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>());
}

// The engine's memory: blocks from the tracker's pool, and buffers registered for peers to reach.
void bindEngineMemory(EngineClass& c) {
  c.def(
       "alloc",
       [](const std::shared_ptr<Engine>& e, size_t nbytes) {
         return blockArray(e, e->tracker().allocate(nbytes), nbytes);
       },
       py::arg("nbytes"))
      .def(
          "register",
          [](Engine& e, const py::buffer& b) {
            Span s = span(b, true);  // peers write into it: read-only memory is refused here
            return e.tracker().registerRegion(s.ptr, s.size, keepAlive(b));  // alive until deregistered
          },
          py::arg("buffer"))
      .def("deregister", [](Engine& e, uint64_t key) { e.tracker().deregisterRegion(key); })
      .def("lookup_or_register", [](Engine& e, const py::buffer& b) {
        Span s = pinnedSpan(e, b, false);
        return e.tracker().lookupOrRegister(s.ptr, s.size);
      });
}

// One-sided writes, reads and flags, and what the engine knows of failed peers.
void bindEngineTransport(EngineClass& c) {
  c.def(
       "write",
       [](Engine& e, int peer, const py::buffer& src, uint64_t key, uint64_t offset) {
         Span s = pinnedSpan(e, src, false);
         guardedNoGil(e, peer, [&] { e.transport().write(peer, s.ptr, key, offset, s.size, e.deadline()); });
       },
       py::arg("peer"), py::arg("src"), py::arg("key"), py::arg("offset") = 0)
      .def(
          "read",
          [](Engine& e, int peer, const py::buffer& dst, uint64_t key, uint64_t offset) {
            Span s = pinnedSpan(e, dst, true);
            guardedNoGil(e, peer,
                         [&] { e.transport().read(peer, s.ptr, key, offset, s.size, e.deadline()); });
          },
          py::arg("peer"), py::arg("dst"), py::arg("key"), py::arg("offset") = 0)
      .def(
          "write_flag",
          [](Engine& e, int peer, uint64_t key, uint64_t offset, uint64_t value) {
            guardedNoGil(e, peer, [&] { e.transport().writeFlag(peer, key, offset, value, e.deadline()); });
          },
          py::arg("peer"), py::arg("key"), py::arg("offset"), py::arg("value"))
      .def("flush",
           [](Engine& e, int peer) {  // until every earlier operation to `peer` completed at the target
             guardedNoGil(e, peer, [&] { e.transport().flush(peer, e.deadline()); });
           })
      .def("check_peer",
           [](Engine& e, int peer) { guarded(e, peer, [&] { e.transport().checkPeer(peer); }); })
      .def_property_readonly(
          "failure",
          [](const Engine& e) -> py::object {
            Engine::Failure f;
            if (!e.failure(&f)) return py::none();
            return py::make_tuple(f.rank, f.reporter, f.why);
          },
          "(failed rank, rank that saw it, what it saw) once any rank reported a failure, else None.")
      .def(
          "wait_flag",
          [](Engine& e, const py::buffer& b, uint64_t offset, uint64_t value, int peer) {
            Span s = span(b, false);
            if (offset > s.size || s.size - offset < 8)
              throw py::value_error(strCat("wait_flag: offset ", offset,
                                           " leaves no 8-byte flag inside a buffer of ", s.size, " bytes"));
            if ((reinterpret_cast<uintptr_t>(s.ptr) + offset) % 8)
              throw py::value_error("wait_flag: the flag's address is not 8-byte aligned");
            py::gil_scoped_release nogil;
            e.waitFlag(static_cast<uint8_t*>(s.ptr) + offset, value, peer, "flag");
          },
          py::arg("buffer"), py::arg("offset"), py::arg("value"), py::arg("peer"));
}

// The tracker's and the transport's counters.
void bindEngineCounters(EngineClass& c) {
  c.def("counters", [](Engine& e) { return countersDict(e.tracker().counters()); })
      .def("traffic", &trafficDict)
      .def("count_received", &Engine::countReceived, py::arg("nbytes"),
           "Adds to bytes_received (protocols built in Python on one-sided writes).");
}

// The channels and collective groups an engine makes.
void bindEngineFactories(EngineClass& c) {
  c.def(
       "static_channel",
       [](const std::shared_ptr<Engine>& e, bool sender, int peer, size_t nbytes) {
         return std::make_shared<StaticChannel>(e, sender ? Role::kSender : Role::kReceiver, peer, nbytes);
       },
       py::arg("sender"), py::arg("peer"), py::arg("nbytes"))
      .def(
          "dynamic_channel",
          [](const std::shared_ptr<Engine>& e, bool sender, int peer) {
            return std::make_shared<DynamicChannel>(e, sender ? Role::kSender : Role::kReceiver, peer);
          },
          py::arg("sender"), py::arg("peer"))
      .def(
          "ring",
          [](const std::shared_ptr<Engine>& e, size_t capacity_bytes, size_t bucket_bytes,
             std::vector<int> members) {
            return std::make_shared<RingAllreduce>(e, capacity_bytes, bucket_bytes, std::move(members));
          },
          py::arg("capacity_bytes"), py::arg("bucket_bytes"), py::arg("members"))
      .def(
          "doubling",
          [](const std::shared_ptr<Engine>& e, size_t capacity_bytes, std::vector<int> members) {
            return std::make_shared<DoublingAllreduce>(e, capacity_bytes, std::move(members));
          },
          py::arg("capacity_bytes"), py::arg("members"));
}

void bindEngine(py::module_& m) {
  EngineClass c(m, "Engine");
  bindEngineLifecycle(c);
  bindEngineMemory(c);
  bindEngineTransport(c);
  bindEngineCounters(c);
  bindEngineFactories(c);
}

void bindStaticChannel(py::module_& m) {
  py::class_<StaticChannel, std::shared_ptr<StaticChannel>>(m, "StaticChannel")
      .def_property_readonly("descriptor", &StaticChannel::localDescriptor)
      .def_property_readonly("nbytes", &StaticChannel::nbytes)
      .def_property_readonly("sequence", &StaticChannel::sequence)
      .def_property_readonly("peer", &StaticChannel::peer)
      .def("connect", &StaticChannel::connect)
      .def_property_readonly(
          "op_handle",
          [](const std::shared_ptr<StaticChannel>& ch) -> uint64_t {
            // 0 where the transport must register the sender's memory: TensorFlow's buffers are not.
            Engine& e = *ch->engine();
            return e.connected() && e.transport().needsLocalRegistration() ? 0 : opHandle(ch);
          },
          "This channel's handle for rdkeras's TensorFlow ops (0: they cannot use it; use send/recv).")
      .def("send",
           [](StaticChannel& ch, const py::buffer& data) {
             Span s = pinnedSpan(*ch.engine(), data, false);
             guardedNoGil(*ch.engine(), ch.peer(), [&] { ch.send(s.ptr, s.size); });
           })
      .def("recv", [](py::object self) {
        auto& ch = self.cast<StaticChannel&>();
        const void* p = guardedNoGil(*ch.engine(), ch.peer(), [&] { return ch.recv(); });
        // A view into the slot; the channel (its owner) stays alive with it.
        return byteArray(p, ch.nbytes(), self);
      });
}

void bindDynamicChannel(py::module_& m) {
  py::class_<DynamicChannel, std::shared_ptr<DynamicChannel>>(m, "DynamicChannel")
      .def_property_readonly("descriptor", &DynamicChannel::localDescriptor)
      .def_property_readonly("sequence", &DynamicChannel::sequence)
      .def_property_readonly("peer", &DynamicChannel::peer)
      .def_property_readonly("acked", &DynamicChannel::acked)
      .def("connect", &DynamicChannel::connect)
      .def("wait_acked",
           [](DynamicChannel& ch, uint64_t count) {
             guardedNoGil(*ch.engine(), ch.peer(), [&] { ch.waitAcked(count); });
           })
      .def(
          "send",
          [](DynamicChannel& ch, const py::buffer& data, const std::string& dtype,
             std::vector<int64_t> shape) {
            Span s = pinnedSpan(*ch.engine(), data, false);
            TensorMeta meta{dtype, std::move(shape), s.size};
            return guardedNoGil(*ch.engine(), ch.peer(), [&] { return ch.send(s.ptr, meta); });
          },
          py::arg("data"), py::arg("dtype"), py::arg("shape"))
      .def("recv", [](DynamicChannel& ch) {
        TensorMeta meta;
        void* p = guardedNoGil(*ch.engine(), ch.peer(), [&] { return ch.recv(&meta); });
        return py::make_tuple(blockArray(ch.engine(), p, meta.nbytes), meta.dtype,
                              py::tuple(py::cast(meta.shape)));
      });
}

void bindRingAllreduce(py::module_& m) {
  py::class_<RingAllreduce, std::shared_ptr<RingAllreduce>>(m, "RingAllreduce")
      .def_property_readonly("descriptor", &RingAllreduce::localDescriptor)
      .def_property_readonly("capacity", &RingAllreduce::capacity)
      .def_property("name", &RingAllreduce::name, &RingAllreduce::setName,
                    "What a hung member's error calls this ring's calls.")
      .def("connect", &RingAllreduce::connect, py::arg("left"), py::arg("right"))
      .def("allreduce", &groupAllreduce<RingAllreduce>, py::arg("arrays"), py::arg("average") = false,
           py::arg("wire") = py::none())
      .def(
          "reduce_scatter",
          [](py::object self, const py::array& array, bool average) {
            auto& ring = self.cast<RingAllreduce&>();
            DType dtype = DType::kFloat32;
            const std::vector<ConstSpan> spans = reduceInputs(*ring.engine(), {array}, &dtype);
            uint8_t* shard = guardedNoGil(*ring.engine(), -1,
                                          [&] { return ring.reduceScatter(spans[0], dtype, average); });
            const auto count = static_cast<py::ssize_t>(array.size() / ring.size());
            return py::array(array.dtype(), {count}, shard, self);
          },
          py::arg("array"), py::arg("average") = false)
      .def(
          "reduce_scatter_parts",
          [](py::object self, const std::vector<py::array>& parts, bool average) {
            auto& ring = self.cast<RingAllreduce&>();
            DType dtype = DType::kFloat32;
            const std::vector<ConstSpan> spans = reduceInputs(*ring.engine(), parts, &dtype);
            uint8_t* shard =
                guardedNoGil(*ring.engine(), -1, [&] { return ring.reduceScatter(spans, dtype, average); });
            py::ssize_t count = 0;
            for (const py::array& part : parts) count += part.size();
            return py::array(parts.empty() ? py::dtype::of<float>() : parts[0].dtype(), {count / ring.size()},
                             shard, self);
          },
          py::arg("parts"), py::arg("average") = false,
          "reduce_scatter of the consecutive `parts` of one buffer, read where they lie.")
      .def(
          "allgather",
          [](py::object self, const py::array& shard) {
            auto& ring = self.cast<RingAllreduce&>();
            if (!(shard.flags() & py::array::c_style))
              throw py::value_error("allgather: the shard must be C-contiguous");
            const ConstSpan span{shard.data(), static_cast<size_t>(shard.nbytes())};
            pin(*ring.engine(), shard, {const_cast<void*>(span.data), span.bytes});
            uint8_t* all = guardedNoGil(*ring.engine(), -1, [&] { return ring.allgather(span); });
            return py::array(shard.dtype(), {static_cast<py::ssize_t>(shard.size() * ring.size())}, all,
                             self);
          },
          py::arg("shard"))
      .def("allreduce_hierarchical", &ringAllreduceHierarchical, py::arg("arrays"), py::arg("average"),
           py::arg("across"), py::arg("world"), py::arg("wire") = py::none(), py::arg("within") = false);
}

void bindDoublingAllreduce(py::module_& m) {
  py::class_<DoublingAllreduce, std::shared_ptr<DoublingAllreduce>>(m, "DoublingAllreduce")
      .def_property_readonly("descriptor", &DoublingAllreduce::localDescriptor)
      .def_property_readonly("capacity", &DoublingAllreduce::capacity)
      .def_property("name", &DoublingAllreduce::name, &DoublingAllreduce::setName,
                    "What a hung member's error calls this group's calls.")
      .def_property_readonly("partners", &DoublingAllreduce::partners)
      .def("connect", &DoublingAllreduce::connect, py::arg("descriptors"))
      .def("allreduce", &groupAllreduce<DoublingAllreduce>, py::arg("arrays"), py::arg("average") = false,
           py::arg("wire") = py::none());
}

// The benchmarks' timed loops in a submodule of their own, so the module's top level is the engine's;
// registered in sys.modules too, so `import rdkeras._engine.bench` (and stubtest) finds it.
void bindBench(py::module_& m) {
  py::module_ loops =
      m.def_submodule("bench", "Timed loops over static channels for the benchmarks (rdkeras.bench).");
  py::module_::import("sys").attr("modules")[loops.attr("__name__")] = loops;
  loops.def("ping_pong", &bench::pingPong, py::arg("tx"), py::arg("rx"), py::arg("iterations"),
            py::arg("initiator"), py::call_guard<py::gil_scoped_release>());
  loops.def("send_many", [](StaticChannel& tx, const py::buffer& data, int iterations) {
    Span s = span(data, false);
    if (s.size != tx.nbytes()) throw py::value_error("data size differs from the channel's message size");
    py::gil_scoped_release nogil;
    return bench::sendMany(tx, s.ptr, iterations);
  });
  loops.def("recv_many", &bench::recvMany, py::call_guard<py::gil_scoped_release>());
}

void bindMemcpy(py::module_& m) {
  m.def(
      "memcpy",
      [](const py::buffer& dst, const py::buffer& src, bool nontemporal) {
        Span d = span(dst, true), s = span(src, false);
        if (d.size != s.size) throw py::value_error("memcpy: sizes differ");
        py::gil_scoped_release nogil;
        if (nontemporal)
          copyNonTemporal(d.ptr, s.ptr, s.size);
        else
          std::memcpy(d.ptr, s.ptr, s.size);
      },
      py::arg("dst"), py::arg("src"), py::arg("nontemporal") = false,
      "Single-thread copy: glibc memcpy, or streaming stores (the physical limits benchmarks compare to).");
}

}  // namespace

// The order is part of the surface: a docstring's signature names a class the Python way only if it is
// bound already, so the Engine's factories (bound before the channel and group classes) say
// rdkeras::StaticChannel and so on; binding those classes first would change the docstrings.
PYBIND11_MODULE(_engine, m) {
  m.doc() = "rdkeras C++ engine: registered memory, one-sided transports, channels.";
  bindErrors(m);
  bindQueries(m);
  bindEngine(m);
  bindStaticChannel(m);
  bindDynamicChannel(m);
  bindRingAllreduce(m);
  bindDoublingAllreduce(m);
  bindBench(m);
  bindMemcpy(m);
}
