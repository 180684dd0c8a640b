// Package ebpfprobes loads and attaches ftkit's eBPF probes.
//
// TCPLogger is the sender-side log of inter-node TCP bytes: a TCX egress
// program (C source in bpf/tcplog.c) copies the payload of every TCP segment
// that belongs to a protected flow into a BPF ring buffer, keyed by sequence
// number, and drops the segment when the ring is full so that TCP retransmits
// it and the log never has a hole. Records are read raw; netlog decodes them.
// The same program keeps, per protected flow, the sender's live TCP state of
// its last transmitted segment (snd_nxt, ACK number, timestamps, window):
// TCPLogger.FlowState, which the restorer reads for the surviving peer.
//
// RecvTap is the receive-side twin: a cgroup_skb/ingress program (bpf/tcprecv.c)
// attached to job cgroups copies every TCP payload byte their sockets
// receive into a ring buffer, in the same record format, in sequence order
// per flow, and drops a segment it cannot record (ring full, a hole before
// it) so that TCP retransmits it.
//
// RecvOrder records receive determinants: a tp_btf/sock_recv_length program
// (bpf/recvorder.c) writes one RecvEvent per successful receive call of the
// jobs below a cgroup parent on their IPv4 TCP sockets (the connection,
// copied_seq after the call, the length, the flags), in an order consistent
// with every thread's program order, and counts per job the events it had to
// lose.
//
// These programs observe packets; the one that rewrites them, the ACK clamp,
// is the package ackclamp. A flow is a tcpflow.Tuple seen from the sending
// socket: Local is the sender, for the receive tap too (it is the remote end).
//
// Everything here needs root (CAP_BPF, CAP_NET_ADMIN) and Linux 6.6+ (TCX,
// dynptr kfuncs).
package ebpfprobes
