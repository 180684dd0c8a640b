//go:build linux

package ebpfprobes

import "golang.org/x/sys/unix"

// pollSyscalls are the readiness system calls the recorder counts (bpf/recvorder.c's poll_nr); arm64 has
// only the p-variants. Unused slots repeat one.
var pollSyscalls = [7]uint32{unix.SYS_EPOLL_PWAIT, unix.SYS_EPOLL_PWAIT2, unix.SYS_PPOLL, unix.SYS_PSELECT6, unix.SYS_PSELECT6, unix.SYS_PSELECT6, unix.SYS_PSELECT6}
