//go:build linux

package ebpfprobes

import "golang.org/x/sys/unix"

// pollSyscalls are the readiness system calls the recorder counts (bpf/recvorder.c's poll_nr).
var pollSyscalls = [7]uint32{unix.SYS_EPOLL_WAIT, unix.SYS_EPOLL_PWAIT, unix.SYS_EPOLL_PWAIT2, unix.SYS_POLL, unix.SYS_PPOLL, unix.SYS_SELECT, unix.SYS_PSELECT6}
