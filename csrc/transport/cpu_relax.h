// The spin-wait hint the transport's waits use between two looks at shared memory.
#pragma once

namespace pipecomm::transport {

// Tells the core this is a spin loop: less power, and the sibling hyperthread runs meanwhile.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace pipecomm::transport
