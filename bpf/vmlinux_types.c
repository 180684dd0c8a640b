//go:build ignore

// vmlinux_types.c names the kernel types the BPF programs in this directory
// use. gen_vmlinux.sh compiles it against the full BTF dump of the running
// kernel and dumps the BTF of the resulting object, which contains exactly
// these types and what they depend on: that is the trimmed vmlinux.h we
// commit. Add a type here (and rerun gen_vmlinux.sh) when a program needs one.
#include "vmlinux_full.h"

// One variable per needed type keeps every type in the object's BTF.
struct __sk_buff *vt_skb;
struct bpf_dynptr *vt_dynptr;
struct ethhdr *vt_eth;
struct iphdr *vt_ip;
struct tcphdr *vt_tcp;
enum bpf_map_type vt_map_type;
enum tcx_action_base vt_tcx;
enum bpf_hdr_start_off vt_hdr_start;
__u8 vt_u8;
__s8 vt_s8;
__u16 vt_u16;
__s16 vt_s16;
__u32 vt_u32;
__s32 vt_s32;
__u64 vt_u64;
__s64 vt_s64;
__be16 vt_be16;
__be32 vt_be32;
__be64 vt_be64;
__wsum vt_wsum;
__sum16 vt_sum16;
