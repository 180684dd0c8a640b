// What the programs that fill a ring buffer for a consumer in user space
// (tcplog.c, tcprecv.c, recvorder.c) share: when a record wakes the consumer,
// and when the consumer is given up for gone.
#pragma once

// UAPI values (enum in linux/bpf.h, not in the trimmed vmlinux.h).
#define BPF_RB_NO_WAKEUP 1
#define BPF_RB_FORCE_WAKEUP 2
#define BPF_RB_AVAIL_DATA 0
#define BPF_RB_CONS_POS 2

// ring_wake_flags returns the submit flags for a record of need bytes in
// ring. While the consumer polls the ring on a short timer by itself
// (polling, which it writes into the program's .bss), a wakeup per record
// (the kernel's default whenever the consumer had caught up) would cost a
// self-IPI on the sending CPU and a context switch of the consumer for every
// record: the record then wakes it only if it makes the ring's fill cross
// wake_bytes. BPF_RB_AVAIL_DATA counts the caller's reserved record already;
// records submitted at once on other CPUs may make us miss the exact
// crossing, and the consumer's poll timer bounds the delay then.
static __always_inline __u64 ring_wake_flags(void *ring, __u32 polling, __u32 wake_bytes, __u64 need)
{
	if (!polling)
		return 0;
	__u64 avail = bpf_ringbuf_query(ring, BPF_RB_AVAIL_DATA);
	if (avail >= wake_bytes && avail < wake_bytes + need)
		return BPF_RB_FORCE_WAKEUP;
	return BPF_RB_NO_WAKEUP;
}

// A consumer that took nothing from the full ring this long is gone: its
// agent stopped, hung or starved.
#define CONSUMER_GONE_NS 4000000000ULL

// ring_consumer_stuck says whether ring's consumer has not moved for
// CONSUMER_GONE_NS, judged when a record found no room: *seen is its position
// when such a look last found it moved, *seen_ns when (the caller's globals,
// updated by every CPU without a lock: a race moves the clock by one
// record's time at most).
static __always_inline int ring_consumer_stuck(void *ring, volatile __u64 *seen, volatile __u64 *seen_ns, __u64 now)
{
	__u64 cons = bpf_ringbuf_query(ring, BPF_RB_CONS_POS);
	if (cons != *seen || !*seen_ns) {
		*seen = cons;
		*seen_ns = now;
		return 0;
	}
	return (__s64)(now - *seen_ns) >= (__s64)CONSUMER_GONE_NS;
}
