package ebpfprobes

// The BPF objects are generated from bpf/*.c against the committed, trimmed
// bpf/vmlinux.h (regenerate that by hand with bpf/gen_vmlinux.sh), so the
// output depends only on the sources and the clang/libbpf-dev versions.
// Only little-endian targets are built: ftkit runs on amd64 and arm64.

//go:generate go tool bpf2go -tags linux -target bpfel -type counters -type flow_key -type flow_state tcplog ../bpf/tcplog.c -- -Wall -Werror

// -mcpu=v3 for the 32-bit compare-and-swap on rx_next (BPF atomics, Linux 5.12+).
//go:generate go tool bpf2go -tags linux -target bpfel -type recv_counters tcprecv ../bpf/tcprecv.c -- -Wall -Werror -mcpu=v3

//go:generate go tool bpf2go -tags linux -target bpfel -type recv_event -type order_counters -type thread_key -type position -type stop recvorder ../bpf/recvorder.c -- -Wall -Werror
