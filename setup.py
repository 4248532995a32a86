"""redirect: Istio-compatible traffic capture for pod network namespaces."""

from setuptools import find_packages, setup

setup(
    name="redirect",
    version="0.1.0",
    description="Capture a pod's traffic and hand it to a local proxy (iptables, nftables, eBPF)",
    packages=find_packages(include=["redirect", "redirect.*"]),
    package_data={"redirect": ["py.typed", "bpf/*.c", "bpf/*.h"]},
    python_requires=">=3.11",
    setup_requires=["cffi>=1.15"],
    install_requires=["cffi>=1.15", "pyroute2>=0.7", "PyYAML>=6"],
    cffi_modules=["native/build_native.py:ffibuilder"],
    entry_points={
        "console_scripts": [
            "redirect=redirect.cli.main:main",
            "redirect-cni=redirect.cni.plugin:main",
            "redirect-agent=redirect.ambient.agent.daemon:main",
            "redirect-nodeproxy=redirect.ambient.nodeproxy:main",
        ],
    },
    zip_safe=False,
)
