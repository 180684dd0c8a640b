package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/ftkit/ftkit/internal/netnsthread"
)

// Netns creates a named network namespace (prefix plus a unique suffix) with its loopback up, removes it
// when the test ends, and returns its path for netnsthread.In.
func Netns(t testing.TB, prefix string) string {
	t.Helper()
	name := fmt.Sprintf("%s-%d-%d", prefix, os.Getpid(), time.Now().UnixNano()%1e9)
	if err := netnsthread.CreateNamed(name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := netns.DeleteNamed(name); err != nil {
			t.Errorf("remove network namespace %s: %v", name, err)
		}
	})
	path := filepath.Join("/var/run/netns", name)
	if err := netnsthread.In(path, func() error {
		lo, err := netlink.LinkByName("lo")
		if err == nil {
			err = netlink.LinkSetUp(lo)
		}
		return err
	}); err != nil {
		t.Fatalf("bring up lo in %s: %v", name, err)
	}
	return path
}
