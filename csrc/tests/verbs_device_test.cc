// The verbs device, port and GID choice, against a fake libibverbs: no RDMA device is needed.
#include "transport/verbs/verbs_device.h"

#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "engine/common.h"

using namespace rdkeras;

namespace {

// A fake host's device: its name, whether it opens, which of ports 1 and 2 are active.
struct FakeDevice {
  std::string name;
  bool opens = true;
  bool active[3] = {false, false, false};  // by port number
  int gids = 1;                            // GID table entries on each port
};

struct FakeHost {
  std::vector<FakeDevice> devices;
  std::vector<ibv_device> handles;
  std::vector<ibv_device*> list;
  std::vector<ibv_context> contexts;
  std::vector<int> closed;  // device indexes, in the order their contexts were closed
  int lists_freed = 0;
};

FakeHost* host = nullptr;

int indexOf(const ibv_device* d) { return static_cast<int>(d - host->handles.data()); }
int indexOf(const ibv_context* c) { return static_cast<int>(c - host->contexts.data()); }

VerbsLib fakeLib() {
  VerbsLib lib = {};
  lib.get_device_list = [](int* n) -> ibv_device** {
    *n = static_cast<int>(host->devices.size());
    return host->devices.empty() ? nullptr : host->list.data();
  };
  lib.free_device_list = [](ibv_device**) { ++host->lists_freed; };
  lib.get_device_name = [](ibv_device* d) -> const char* { return d->name; };
  lib.open_device = [](ibv_device* d) -> ibv_context* {
    return host->devices[indexOf(d)].opens ? &host->contexts[indexOf(d)] : nullptr;
  };
  lib.close_device = [](ibv_context* c) {
    host->closed.push_back(indexOf(c));
    return 0;
  };
  lib.query_port = [](ibv_context* c, uint8_t port, ibv_port_attr* attr) {
    if (port < 1 || port > 2) return -1;
    attr->state = host->devices[indexOf(c)].active[port] ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
    attr->lid = static_cast<uint16_t>(100 * indexOf(c) + port);
    return 0;
  };
  lib.query_gid = [](ibv_context* c, uint8_t, int index, ibv_gid* gid) {
    if (index < 0 || index >= host->devices[indexOf(c)].gids) return -1;
    std::memset(gid->raw, index + 1, sizeof(gid->raw));
    return 0;
  };
  return lib;
}

// Sets up `devices` as the host's for one test case.
struct Host {
  FakeHost fake;
  explicit Host(std::vector<FakeDevice> devices) {
    fake.devices = std::move(devices);
    fake.handles.resize(fake.devices.size());
    fake.contexts.resize(fake.devices.size());
    for (size_t i = 0; i < fake.devices.size(); ++i) {
      std::strncpy(fake.handles[i].name, fake.devices[i].name.c_str(), sizeof(fake.handles[i].name) - 1);
      fake.list.push_back(&fake.handles[i]);
    }
    fake.list.push_back(nullptr);
    host = &fake;
  }
  ~Host() { host = nullptr; }
};

FakeDevice device(const std::string& name, bool port1, bool port2) {
  FakeDevice d;
  d.name = name;
  d.active[1] = port1;
  d.active[2] = port2;
  return d;
}

}  // namespace

TEST_CASE("the first device with an active port is chosen, and the others are closed") {
  Host h({device("mlx5_0", false, false), device("mlx5_1", false, true), device("mlx5_2", true, true)});
  const VerbsLib lib = fakeLib();
  const VerbsDevice d = openVerbsDevice(lib, TransportOptions{});
  CHECK(d.name == "mlx5_1");
  CHECK(d.ctx == &h.fake.contexts[1]);
  CHECK(d.port == 2);  // port 1 is down
  CHECK(d.port_attr.lid == 102);
  CHECK(d.gid_index == 0);
  CHECK(d.gid.raw[0] == 1);
  CHECK(h.fake.closed == std::vector<int>{0});  // mlx5_2 was never opened
  CHECK(h.fake.lists_freed == 1);
}

TEST_CASE("RDKERAS_IB_DEVICE, RDKERAS_IB_PORT and RDKERAS_IB_GID_INDEX choose") {
  FakeDevice b = device("mlx5_1", true, true);
  b.gids = 4;
  Host h({device("mlx5_0", true, true), b});
  const VerbsLib lib = fakeLib();
  TransportOptions options;
  options.ib_device = "mlx5_1";
  options.ib_port = 2;
  options.ib_gid_index = 3;
  const VerbsDevice d = openVerbsDevice(lib, options);
  CHECK(d.name == "mlx5_1");
  CHECK(d.port == 2);
  CHECK(d.gid_index == 3);
  CHECK(d.gid.raw[15] == 4);
  CHECK(h.fake.closed.empty());  // mlx5_0 was skipped by name, not opened
}

TEST_CASE("a device that does not open is passed over") {
  FakeDevice broken = device("rxe0", true, false);
  broken.opens = false;
  Host h({broken, device("rxe1", true, false)});
  const VerbsLib lib = fakeLib();
  CHECK(openVerbsDevice(lib, TransportOptions{}).name == "rxe1");
}

TEST_CASE("no active port: the error lists the devices and the variables to set") {
  Host h({device("mlx5_0", false, false), device("mlx5_1", false, false)});
  const VerbsLib lib = fakeLib();
  CHECK_THROWS_WITH_AS(openVerbsDevice(lib, TransportOptions{}),
                       "verbs: no active port on any device (devices: mlx5_0, mlx5_1); set "
                       "RDKERAS_IB_DEVICE / RDKERAS_IB_PORT",
                       EngineError);
  CHECK(h.fake.closed == std::vector<int>{0, 1});
  TransportOptions options;
  options.ib_device = "mlx5_1";
  options.ib_port = 1;
  CHECK_THROWS_WITH_AS(openVerbsDevice(lib, options),
                       "verbs: no active port 1 on mlx5_1 (devices: mlx5_0, mlx5_1); set RDKERAS_IB_DEVICE / "
                       "RDKERAS_IB_PORT",
                       EngineError);
}

TEST_CASE("a missing GID index is an error, and the device is closed") {
  Host h({device("rxe0", true, false)});
  const VerbsLib lib = fakeLib();
  TransportOptions options;
  options.ib_gid_index = 1;
  CHECK_THROWS_WITH_AS(openVerbsDevice(lib, options), "verbs: cannot read GID index 1 of rxe0 port 1",
                       EngineError);
  CHECK(h.fake.closed == std::vector<int>{0});
}

TEST_CASE("no device at all says how to make one") {
  Host h({});
  const VerbsLib lib = fakeLib();
  CHECK_THROWS_WITH_AS(openVerbsDevice(lib, TransportOptions{}),
                       doctest::Contains("transport 'verbs' is not viable: no RDMA device (for SoftRoCE"),
                       EngineError);
}
