// Posting buffers for an IPC channel's incoming messages ahead of their arrival, and dropping them after.
#include "ipc_posted_buffers.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <optional>

#include "../op_checks.h"
#include "ring_tags.h"

namespace pipecomm::transport {

std::shared_ptr<const Layout> make_layout(MessageMeta meta) {
  std::vector<int64_t> nbytes;
  for (const EntryMeta& entry : meta) {
    if (entry.present) {
      nbytes.push_back(c10::multiply_integers(entry.sizes) * static_cast<int64_t>(c10::elementSize(entry.dtype)));
    }
  }
  const uint64_t digest = fingerprint(meta);
  return std::make_shared<const Layout>(Layout{std::move(meta), digest, packed_offsets_of_bytes(nbytes)});
}

// Built as at::empty builds a CUDA tensor, without a dispatcher call per entry.
Entries views_of(const at::Tensor& buffer, const Layout& layout) {
  Entries entries;
  entries.reserve(layout.meta.size());
  size_t present = 0;
  for (const EntryMeta& entry : layout.meta) {
    if (!entry.present) {
      entries.emplace_back(std::nullopt);
      continue;
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()),
                                                     c10::DispatchKeySet(c10::DispatchKey::CUDA),
                                                     caffe2::TypeMeta::fromScalarType(entry.dtype));
    impl->set_sizes_contiguous(entry.sizes);
    // Packed offsets are multiples of kPackAlignment, which every element size divides.
    impl->set_storage_offset(layout.offsets[present++] / static_cast<int64_t>(c10::elementSize(entry.dtype)));
    entries.emplace_back(at::Tensor(std::move(impl)));
  }
  return entries;
}

void PostedBuffers::post_ahead(uint64_t first_seq, const std::shared_ptr<const Layout>& layout, cudaStream_t caller,
                               IpcRingReceiver& receiver, ShmRingSender& post_ring, uint64_t decided_after) {
  if (!enabled_ || layout->offsets.back() == 0) return;
  const int64_t bytes = layout->offsets.back();
  const uint64_t digest = layout->fingerprint;
  // One layout's posts are made in message order, so the messages that have one of this layout are
  // those before unposted_seq_: a scan only when the layout differs from the last one posted (a
  // search per message costs microseconds with many slots).
  if (digest != posted_digest_) {
    posted_digest_ = digest;
    unposted_seq_ = 0;
    for (const PostedBuffer& posted : posts_) {
      if (posted.layout->fingerprint == digest) unposted_seq_ = std::max(unposted_seq_, posted.seq + 1);
    }
  }
  for (uint64_t seq = std::max(first_seq, unposted_seq_); seq < first_seq + depth_; ++seq) {
    if (!post_ring.can_send_now()) return;  // the sender is not taking posts: it is not sending
    at::Tensor buffer;
    try {
      buffer = pool_.allocate(bytes);
    } catch (const c10::OutOfMemoryError&) {
      return;
    }
    if (!buffer.defined()) {
      enabled_ = false;  // no pool to keep its segments from being freed under the peer
      return;
    }
    PostRecord record{seq, next_post_, digest, static_cast<uint64_t>(bytes), 0, {}};
    cudaIpcMemHandle_t handle;
    size_t offset = 0;
    if (!receiver.export_pointer(buffer.data_ptr(), &handle, &offset)) {
      enabled_ = false;  // e.g. expandable segments: the slot path carries everything
      return;
    }
    std::memcpy(record.handle.data(), &handle, sizeof(handle));
    record.offset = offset;
    receiver.enqueue_post(next_post_++, caller);
    try {
      post_ring.send_bytes(&record, sizeof(record), kTagPost);
    } catch (const ChannelError&) {
      enabled_ = false;  // the peer closed: it sends nothing more
      return;
    }
    posts_.push_back({seq, record.post, layout, std::move(buffer), caller, seq >= decided_after});
    unposted_seq_ = seq + 1;
  }
}

const PostedBuffer* PostedBuffers::find(uint64_t seq, uint64_t post) const {
  for (const PostedBuffer& posted : posts_) {
    if (posted.seq == seq && posted.post == post) return &posted;
  }
  return nullptr;
}

const PostedBuffer* PostedBuffers::find_before_decision(uint64_t seq, uint64_t fingerprint) const {
  for (const PostedBuffer& posted : posts_) {
    if (posted.seq == seq && posted.before_decision && posted.layout->fingerprint == fingerprint) return &posted;
  }
  return nullptr;
}

void PostedBuffers::drop_through(uint64_t seq) {
  // Posts are in message order but after a layout change: the front ones go without moving the rest.
  while (!posts_.empty() && posts_.front().seq <= seq) posts_.pop_front();
  posts_.erase(std::remove_if(posts_.begin(), posts_.end(), [&](const PostedBuffer& posted) { return posted.seq <= seq; }),
               posts_.end());
}

void PostedBuffers::close(bool give_memory_back) {
  // A posted buffer the peer may still map, or still be copying into, never serves another allocation.
  posts_.clear();
  if (give_memory_back) pool_.release();
}

}  // namespace pipecomm::transport
