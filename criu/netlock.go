package criu

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/procstate"
)

// lockLine is how CRIU's dump log (log level 4) shows each connection it adds to its network lock
// (criu/netfilter.c, nftables_lock_connection_raw): "Running nftables [add element inet CRIU-<run id> conns4
// { ... }]". The log is the only place the daemon can learn the lock's name: CRIU names the table after its
// run id, which it logs before the log file is open and writes to inventory.img only at the dump's end.
const lockLine = "\tRunning nftables [add element inet "

// lockTableRE is the table CRIU's lock uses: "CRIU-" and the first 21 characters of its run id (a UUID).
var lockTableRE = regexp.MustCompile(`^CRIU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{2}$`)

// leftLock returns the nftables table (family inet) of the network lock whose connections the dump logged
// at path locked, "" if the log names none (no connection locked: the table, if CRIU made it, drops
// nothing). The log holds file names of the job's, which may imitate a line: every line must name the same
// table, else the name is not trusted and nothing is deleted.
func leftLock(path string) (string, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	defer f.Close()
	table := ""
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		_, rest, ok := strings.Cut(sc.Text(), lockLine)
		if !ok {
			continue
		}
		name, _, _ := strings.Cut(rest, " ")
		if !lockTableRE.MatchString(name) || (table != "" && name != table) {
			return "", fmt.Errorf("%s names lock tables %q and %q: not trusted", path, table, name)
		}
		table = name
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read %s: %w", path, err)
	}
	return table, nil
}

// deleteTable deletes the nftables table (family inet) name in the calling thread's network namespace; a
// missing table is not an error (add then delete in one transaction).
func deleteTable(name string) error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	t := &nftables.Table{Name: name, Family: nftables.TableFamilyINet}
	c.AddTable(t)
	c.DelTable(t)
	return c.Flush()
}

// unlockLeft removes the network lock a CRIU that ended without answering (killed at the dump's deadline)
// left: CRIU removes it itself at the end of every dump that fails, but a killed one cannot, and the lock
// drops every packet of the job's connections while the job, thawed, runs on. It runs in CRIU's network
// namespace (opts.Netns), where the lock is.
func (c Client) unlockLeft(opts DumpOptions, logPath string) error {
	table, err := leftLock(logPath)
	if err != nil {
		return fmt.Errorf("find the network lock CRIU left: %w: the job's connections may stay blocked; look for an nftables table inet CRIU-* (in the job network if it has one)", err)
	}
	if table == "" {
		return nil
	}
	unlock := c.UnlockNetwork
	if unlock == nil {
		unlock = deleteTable
	}
	if err := inNetns(opts.Netns, func() error { return unlock(table) })(); err != nil {
		return fmt.Errorf("remove the network lock CRIU left: %w: the job's connections stay blocked; delete it by hand (nft delete table inet %s, in the job network if it has one)", err, table)
	}
	return nil
}

// releaseRepair turns TCP repair mode off on every socket of the tree rooted at pid that has it on, as
// CRIU does at the end of every dump it finishes, failed or not (libsoccr_resume): one killed before its
// end left the sockets of the tree it dumped in repair mode, where they transmit nothing, and the job,
// thawed, hung on its connections for good without a word. The kernel resets SO_REUSEADDR with repair
// mode; the value CRIU kept to put back died with it (it matters only to a bind, which a connected socket
// does not make again).
func releaseRepair(pid int) error {
	pids, err := procstate.Tree(pid)
	if err != nil {
		return fmt.Errorf("turn TCP repair mode off on the sockets of the dumped tree: %w", err)
	}
	seen := map[string]bool{} // sockets by /proc's name for them: one may be held by many processes
	var errs []error
	for _, p := range pids {
		if err := releaseRepairOf(p, seen); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("turn TCP repair mode off on the sockets of the dumped tree: %w: its connections stay stalled; kill the job and restore it from its last snapshot", err)
	}
	return nil
}

// releaseRepairOf is releaseRepair for the sockets of process pid; a process that is gone holds none.
func releaseRepairOf(pid int, seen map[string]bool) error {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("process %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return fmt.Errorf("process %d: %w", pid, err)
	}
	var errs []error
	for _, e := range ents {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
		n, nerr := strconv.Atoi(e.Name())
		if err != nil || nerr != nil || !strings.HasPrefix(link, "socket:") || seen[link] {
			continue // closed since, or no socket
		}
		seen[link] = true
		fd, err := unix.PidfdGetfd(pidfd, n, 0)
		if err != nil {
			continue // closed since
		}
		// Any other socket refuses the option: only TCP's may be in repair mode.
		if on, err := unix.GetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR); err == nil && on == 1 {
			if err := unix.SetsockoptInt(fd, unix.SOL_TCP, unix.TCP_REPAIR, unix.TCP_REPAIR_OFF); err != nil {
				errs = append(errs, fmt.Errorf("%s of process %d: %w", link, pid, err))
			}
		}
		unix.Close(fd)
	}
	return errors.Join(errs...)
}
