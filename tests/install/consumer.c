/* Built against an installed tierd through pkg-config: the C ABI alone. */
#include <stdio.h>

#include "tierd/client.h"

int main(void) {
  printf("abi %d\n", tierd_abi_version());
  return tierd_abi_version() > 0 ? 0 : 1;
}
