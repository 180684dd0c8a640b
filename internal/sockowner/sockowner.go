// Package sockowner names the processes that hold sockets, found by the sockets' inode numbers in the
// descriptors /proc lists (what ss -p does), parsed by prometheus/procfs.
package sockowner

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/procfs"
)

// Process is a process that holds a socket.
type Process struct {
	PID  int
	Comm string // its command name (at most 15 bytes), "" if it could not be read
}

// Find returns, for each of the socket inodes asked for, the first process found holding it: one pass over
// the processes of proc (a procfs.FS of the host's /proc). An inode no process holds is left out. A process
// that exits during the pass, or whose descriptors cannot be read, is skipped.
func Find(proc procfs.FS, inodes []uint32) (map[uint32]Process, error) {
	want := make(map[string]uint32, len(inodes))
	for _, ino := range inodes {
		want["socket:["+strconv.FormatUint(uint64(ino), 10)+"]"] = ino
	}
	found := map[uint32]Process{}
	if len(want) == 0 {
		return found, nil
	}
	procs, err := proc.AllProcs()
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	for _, p := range procs {
		targets, err := p.FileDescriptorTargets()
		if err != nil {
			continue // it exited meanwhile, or its descriptors cannot be read: nothing to name
		}
		for _, t := range targets {
			if !strings.HasPrefix(t, "socket:[") {
				continue
			}
			ino, ok := want[t]
			if !ok {
				continue
			}
			if _, done := found[ino]; done {
				continue
			}
			comm, _ := p.Comm()
			found[ino] = Process{PID: p.PID, Comm: comm}
		}
		if len(found) == len(want) {
			break
		}
	}
	return found, nil
}
