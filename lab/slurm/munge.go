package slurm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Debian's munge paths: every Slurm daemon and client of the lab reaches munged through this socket,
// which all lab hosts see because they share the machine's mount namespace.
const (
	MungeSocket  = "/run/munge/munge.socket.2"
	mungeRunDir  = "/run/munge"
	mungePidFile = "/run/munge/munged.pid"
)

// RunningMunged returns the munged of the root namespace if one runs (started by anyone).
func RunningMunged() (Proc, bool) {
	b, err := os.ReadFile(mungePidFile)
	if err != nil {
		return Proc{}, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return Proc{}, false
	}
	comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	if err != nil || strings.TrimSpace(string(comm)) != "munged" {
		return Proc{}, false // a stale pid file
	}
	p, err := Identify("munged", "", pid)
	return p, err == nil && p.Alive()
}

// StartMunged starts munged as the munge user in the calling thread's namespaces (the root namespace)
// and waits until its socket accepts connections.
func StartMunged(ctx context.Context, logPath string) (Proc, error) {
	bin, err := Binary("munged")
	if err != nil {
		return Proc{}, err
	}
	u, err := user.Lookup("munge")
	if err != nil {
		return Proc{}, fmt.Errorf("munge user: %w; install munge (scripts/setup.sh packages)", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	// /run is a tmpfs: after a reboot the directory is gone until someone (systemd's tmpfiles) recreates it.
	if err := os.MkdirAll(mungeRunDir, 0o755); err != nil {
		return Proc{}, fmt.Errorf("create %s: %w", mungeRunDir, err)
	}
	if err := os.Chown(mungeRunDir, uid, gid); err != nil {
		return Proc{}, fmt.Errorf("chown %s to munge: %w", mungeRunDir, err)
	}
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return Proc{}, err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "--foreground")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
	p, err := StartDaemon(cmd, "munged", "")
	if err != nil {
		return Proc{}, err
	}
	err = Poll(ctx, 15*time.Second, func() error {
		if !p.Alive() {
			return fmt.Errorf("munged exited; see %s and /var/log/munge/munged.log", logPath)
		}
		c, err := net.Dial("unix", MungeSocket)
		if err != nil {
			return err
		}
		return c.Close()
	})
	if err != nil {
		return p, fmt.Errorf("munged did not come up: %w", err)
	}
	return p, nil
}

// StartDaemon starts cmd (already placed in its namespace by the caller's thread), reaps it in the
// background so that it never lingers as a zombie of a long-lived caller, and records its identity.
func StartDaemon(cmd *exec.Cmd, name, host string) (Proc, error) {
	if err := cmd.Start(); err != nil {
		return Proc{}, fmt.Errorf("start %s: %w", name, err)
	}
	go cmd.Wait() //nolint:errcheck // the exit status is in the daemon's log; Stop checks liveness by pid
	return Identify(name, host, cmd.Process.Pid)
}

// Binary finds a Slurm or munge daemon or client: on PATH, else in Debian's /usr/sbin and /usr/bin
// (a non-login root shell may lack the sbin directories).
func Binary(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/usr/bin"} {
		p := dir + "/" + name
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: %w; install slurmctld slurmd slurm-client munge (scripts/setup.sh packages)", name, fs.ErrNotExist)
}

// Missing reports which of the daemons and clients the lab needs are missing.
func Missing() []string {
	var out []string
	for _, b := range []string{"munged", "slurmctld", "slurmd", "sinfo", "srun", "sbatch", "scontrol"} {
		if _, err := Binary(b); err != nil {
			out = append(out, b)
		}
	}
	return out
}

// Poll calls check until it returns nil, ctx ends or bound passes; the last error explains a timeout.
func Poll(ctx context.Context, bound time.Duration, check func() error) error {
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	for {
		err := check()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return errors.Join(fmt.Errorf("not within %s: %w", bound, ctx.Err()), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
