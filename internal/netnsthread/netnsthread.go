// Package netnsthread runs code on an OS thread that has joined another network namespace, and creates
// named namespaces, without ever leaving a thread of the process in the wrong namespace.
package netnsthread

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// RunDir is where named network namespaces are bind-mounted (`ip netns`, vishvananda/netns).
const RunDir = "/run/netns"

// In runs fn on an OS thread that has joined the network namespace at path and returns fn's error as is.
// Processes started from fn (os/exec forks from the calling thread) inherit that namespace, with the
// host's mount namespace: `nsenter --net` semantics, which CRIU needs (`ip netns exec` remounts /sys and
// breaks CRIU).
func In(path string, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// If anything below fails to restore the original namespace, the goroutine exits still locked
		// and the runtime discards the thread instead of reusing a thread in the wrong namespace.
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("get current network namespace: %w", err)
			return
		}
		defer orig.Close()
		target, err := netns.GetFromPath(path)
		if err != nil {
			errc <- fmt.Errorf("open network namespace %s: %w", path, err)
			return
		}
		defer target.Close()
		if err := netns.Set(target); err != nil {
			errc <- fmt.Errorf("enter network namespace %s: %w", path, err)
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err == nil {
			runtime.UnlockOSThread()
		}
		errc <- ferr
	}()
	return <-errc
}

// CreateNamed makes a new network namespace bind-mounted at /var/run/netns/NAME (the `ip netns`
// convention) without moving the calling goroutine's thread into it.
func CreateNamed(name string) error {
	if err := ShareRunDir(); err != nil {
		return fmt.Errorf("create network namespace %s: %w", name, err)
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("get current network namespace: %w", err)
			return
		}
		defer orig.Close()
		h, err := netns.NewNamed(name) // switches this thread into the new namespace
		if err != nil {
			errc <- fmt.Errorf("create network namespace %s: %w", name, err)
			return
		}
		h.Close()
		if err := netns.Set(orig); err == nil {
			runtime.UnlockOSThread()
		}
		errc <- nil
	}()
	return <-errc
}

// ShareRunDir makes RunDir a mount point of its own with shared propagation, as `ip netns add` does before
// it mounts a namespace there (CreateNamed calls it). A namespace mounted on a plain directory is hidden by
// the first `ip netns add` run after it, by anyone: that bind-mounts the directory onto itself, and on a
// host whose root mount is not shared the namespace's own mount stays underneath, out of reach of an
// unmount by its path, its file impossible to remove ("device or resource busy") and the namespace alive
// (two lab hosts of a CI run were left so). Once RunDir is a mount point, `ip netns add` only makes it
// shared again.
func ShareRunDir() error {
	if err := os.MkdirAll(RunDir, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", RunDir, err)
	}
	for bound := false; ; bound = true {
		err := unix.Mount("", RunDir, "none", unix.MS_SHARED|unix.MS_REC, "")
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EINVAL) || bound {
			return fmt.Errorf("make %s a shared mount: %w", RunDir, err)
		}
		// EINVAL: not a mount point yet.
		if err := unix.Mount(RunDir, RunDir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind-mount %s onto itself: %w", RunDir, err)
		}
	}
}
