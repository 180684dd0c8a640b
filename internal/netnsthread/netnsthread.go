// Package netnsthread runs code on an OS thread that has joined another network namespace, and creates
// named namespaces, without ever leaving a thread of the process in the wrong namespace.
package netnsthread

import (
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

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
