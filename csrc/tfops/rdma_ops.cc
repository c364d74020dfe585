// RdkerasSend / RdkerasRecv: the engine's static channels as native TensorFlow kernels.
//
// The pipeline's transfers used to be tf.numpy_function ops: every one took the GIL, entered Python and
// built numpy arrays around the buffers (~60 us a hop before any byte moved). These kernels call the
// engine straight through the C table of op_api.h: the send writes TensorFlow's buffer into the
// receiver's registered slot; the receive hands TensorFlow the slot itself (a TensorBuffer over it, as
// the numpy path's aliasing did), so nothing is serialized and nothing is copied on the receiving side.
//
// Built by rdkeras.tf_ops against the installed TensorFlow's headers on first use; it links neither the
// engine nor Python.
#include <string>
#include <vector>

#include "op_api.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::shape_inference::InferenceContext;

REGISTER_OP("RdkerasSend")
    .Input("tensors: T")
    .Output("token: int32")
    .Attr("T: list(type) >= 1")
    .Attr("channels: list(int)")
    .Attr("api: int")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Sends each tensor over its static channel, in order; the token orders later ops after it.");

REGISTER_OP("RdkerasRecv")
    .Output("tensors: T")
    .Attr("T: list(type) >= 1")
    .Attr("shapes: list(shape)")
    .Attr("channels: list(int)")
    .Attr("api: int")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      std::vector<tensorflow::PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      for (size_t i = 0; i < shapes.size(); ++i) {
        tensorflow::shape_inference::ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(static_cast<int>(i), s);
      }
      return absl::OkStatus();
    })
    .Doc("The next tensor from each static channel, in order, in place in its registered slot.");

// The engine's table, from the op's `api` attr; null (and the construction failed) where it is not one.
const RdkerasOpApi* tableOf(OpKernelConstruction* ctx) {
  tensorflow::int64 address = 0;
  auto status = ctx->GetAttr("api", &address);
  auto* api = reinterpret_cast<const RdkerasOpApi*>(address);
  if (status.ok() && (api == nullptr || api->version != RDKERAS_OP_API_VERSION))
    status = tensorflow::errors::FailedPrecondition(
        "rdkeras: the TensorFlow ops library does not match the engine module; reinstall rdkeras");
  if (!status.ok()) {
    ctx->CtxFailure(__FILE__, __LINE__, status);
    return nullptr;
  }
  return api;
}

// A received tensor's memory: the channel's slot, kept alive (the channel) until TensorFlow drops it.
class SlotBuffer : public tensorflow::TensorBuffer {
 public:
  SlotBuffer(const RdkerasOpApi* api, const void* data, size_t n, void* keep)
      : TensorBuffer(const_cast<void*>(data)), api_(api), n_(n), keep_(keep) {}
  ~SlotBuffer() override { api_->release(keep_); }
  size_t size() const override { return n_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(static_cast<tensorflow::int64>(n_));
    proto->set_allocator_name("rdkeras_slot");
  }
  bool OwnsMemory() const override { return false; }  // TensorFlow never writes into it in place

 private:
  const RdkerasOpApi* api_;
  size_t n_;
  void* keep_;
};

class SendOp : public OpKernel {
 public:
  explicit SendOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channels", &channels_));
    api_ = tableOf(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    OP_REQUIRES(ctx, static_cast<size_t>(ctx->num_inputs()) == channels_.size(),
                tensorflow::errors::InvalidArgument("rdkeras send: ", ctx->num_inputs(), " tensors for ",
                                                    channels_.size(), " channels"));
    char err[1024];
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const tensorflow::Tensor& t = ctx->input(i);
      const auto bytes = t.tensor_data();
      OP_REQUIRES(ctx, api_->send(channels_[i], bytes.data(), bytes.size(), err, sizeof(err)) == 0,
                  tensorflow::errors::Aborted("rdkeras send (", name(), "): ", err));
    }
    tensorflow::Tensor* token = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &token));
    token->scalar<tensorflow::int32>()() = 0;
  }

 private:
  std::vector<tensorflow::int64> channels_;
  const RdkerasOpApi* api_ = nullptr;
};

class RecvOp : public OpKernel {
 public:
  explicit RecvOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channels", &channels_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("T", &types_));
    std::vector<tensorflow::PartialTensorShape> shapes;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shapes", &shapes));
    OP_REQUIRES(ctx, shapes.size() == channels_.size() && types_.size() == channels_.size(),
                tensorflow::errors::InvalidArgument("rdkeras recv: one shape and type per channel"));
    for (const auto& s : shapes) {
      tensorflow::TensorShape full;
      OP_REQUIRES(
          ctx, s.AsTensorShape(&full),
          tensorflow::errors::InvalidArgument("rdkeras recv: a static channel's shape is fully known"));
      shapes_.push_back(full);
    }
    api_ = tableOf(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    char err[1024];
    for (size_t i = 0; i < channels_.size(); ++i) {
      const void* data = nullptr;
      size_t n = 0;
      void* keep = nullptr;
      OP_REQUIRES(ctx, api_->recv(channels_[i], &data, &n, &keep, err, sizeof(err)) == 0,
                  tensorflow::errors::Aborted("rdkeras recv (", name(), "): ", err));
      auto* buffer = new SlotBuffer(api_, data, n, keep);
      const size_t expected = shapes_[i].num_elements() * tensorflow::DataTypeSize(types_[i]);
      if (n != expected) {
        buffer->Unref();
        ctx->SetStatus(tensorflow::errors::InvalidArgument(
            "rdkeras recv (", name(), "): the channel carries ", n, " bytes, the op expects ", expected));
        return;
      }
      ctx->set_output(static_cast<int>(i), tensorflow::Tensor(types_[i], shapes_[i], buffer));
      buffer->Unref();  // the tensor holds its own reference
    }
  }

 private:
  std::vector<tensorflow::int64> channels_;
  tensorflow::DataTypeVector types_;
  std::vector<tensorflow::TensorShape> shapes_;
  const RdkerasOpApi* api_ = nullptr;
};

REGISTER_KERNEL_BUILDER(Name("RdkerasSend").Device(tensorflow::DEVICE_CPU), SendOp);
REGISTER_KERNEL_BUILDER(Name("RdkerasRecv").Device(tensorflow::DEVICE_CPU), RecvOp);

}  // namespace
