package ebpfprobes

// The BPF objects are generated from bpf/*.c against the committed, trimmed
// bpf/vmlinux.h (regenerate that by hand with bpf/gen_vmlinux.sh), so the
// output depends only on the sources and the clang/libbpf-dev versions.
// Only little-endian targets are built: ftkit runs on amd64 and arm64.

//go:generate go tool bpf2go -tags linux -target bpfel -type counters -type flow_key -type flow_state tcplog ../bpf/tcplog.c -- -Wall -Werror
